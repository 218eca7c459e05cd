"""Placeholder: being written."""

def DynamicLossScale(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def adjust_loss_scale(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def all_finite(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def dynamic_loss_scale(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def scale_loss(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def unscale_grads(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

