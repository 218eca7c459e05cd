"""Placeholder: being written."""

def AccumBatchNorm(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def convert_batch_norm_variables(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

