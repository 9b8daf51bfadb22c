"""``lightning.pytorch.profilers``: refused where imported, in one line (``Trainer(profiler=...)`` is refused there
too): distrain times its steps itself (``step_time`` in the metrics, the stragglers), and torch's profiler runs around
``fit`` or in a callback."""

from distrain.lightning._refuse import refusing

__getattr__ = refusing(
    __name__, "run torch.profiler around fit, or in a callback's on_train_batch_start/end (step times are logged)"
)
