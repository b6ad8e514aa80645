"""Errors raised by the checkpoint readers and writers."""


class CheckpointError(ValueError):
    """A checkpoint is missing, partial, corrupt or does not fit the model."""
