"""Checkpoint files: atomic directory writes (``io``), safe reads (``safe_load``), live state (``state``)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the rank or file at fault."""
