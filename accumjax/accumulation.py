"""Placeholder: being written."""

def AccumulationState(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def AccumulationStats(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def accumulate(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def accumulated_gradients(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def has_updated(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def reset(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def should_update(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def stats(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

