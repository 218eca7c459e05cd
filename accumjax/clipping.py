"""Placeholder: being written."""

def adaptive_clip(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def adaptive_clip_grad(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def compute_norm(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def unitwise_norm(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

