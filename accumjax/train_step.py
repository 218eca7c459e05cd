"""Placeholder: being written."""

def TrainState(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

def make_train_step(*args, **kwargs):  # noqa: D103
    raise NotImplementedError

