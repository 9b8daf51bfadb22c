"""``lightning.pytorch.callbacks``: the stock callbacks distrain has, under Lightning's names."""

from distrain.callbacks import Callback, EarlyStopping, LearningRateMonitor, ProgressBar, Timer
from distrain.callbacks import ModelCheckpoint as _ModelCheckpoint
from distrain.lightning._refuse import refusing


class ModelCheckpoint(_ModelCheckpoint):
    """distrain's ``ModelCheckpoint`` with Lightning's defaults and paths: ``filename`` ``{epoch}-{step}`` with each
    field's name inserted and ``.ckpt`` appended (``epoch=3-step=120.ckpt``, ``epoch=3-val_loss=0.25.ckpt``: a
    directory, as Lightning's sharded strategies write theirs), a name that exists already versioned
    (``epoch=3-step=120-v1.ckpt``) rather than replaced, and with ``save_last=True`` a ``last.ckpt`` link to the
    newest, which ``last_model_path`` gives ("" without it: Lightning's default, ``save_last=None``; distrain's own
    ``last`` link is there unless ``save_last=False``). ``FILE_EXTENSION`` and ``CHECKPOINT_NAME_LAST`` are
    Lightning's class attributes (``"{epoch}-last"``: the link named by the epoch)."""

    FILE_EXTENSION = ".ckpt"
    CHECKPOINT_NAME_LAST = "last"

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        *,  # Lightning's next positional argument is verbose, distrain's mode: keywords only past here
        save_last: bool | str | None = None,
        auto_insert_metric_name: bool = True,
        enable_version_counter: bool = True,
        **kwargs,
    ):
        if save_last not in (True, False, None, "link"):
            raise ValueError(f"ModelCheckpoint save_last must be True, False, None or 'link', got {save_last!r}")
        super().__init__(
            dirpath,
            filename,
            monitor,
            # distrain's `last` (what ckpt_path="last" and a requeued job resume) unless save_last=False says otherwise
            save_last=save_last is not False,
            auto_insert_metric_name=auto_insert_metric_name,
            enable_version_counter=enable_version_counter,
            **kwargs,
        )
        self.names_last = save_last in (True, "link")  # Lightning's last.ckpt only when asked, as in Lightning


#: Lightning's progress bars: distrain draws its own, one line per logging step where the output is not a terminal
TQDMProgressBar = RichProgressBar = ProgressBar

__all__ = [
    "Callback",
    "EarlyStopping",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ProgressBar",
    "RichProgressBar",
    "TQDMProgressBar",
    "Timer",
]


__getattr__ = refusing(__name__)
