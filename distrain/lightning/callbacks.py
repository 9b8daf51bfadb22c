"""``lightning.pytorch.callbacks``: the stock callbacks distrain has, under Lightning's names."""

import math

from distrain.callbacks import (
    BasePredictionWriter,
    Callback,
    DeviceStatsMonitor,
    EarlyStopping,
    EMAWeightAveraging,
    LearningRateFinder,
    LearningRateMonitor,
    ProgressBar,
    StochasticWeightAveraging,
    Timer,
    WeightAveraging,
)
from distrain.callbacks import ModelCheckpoint as _ModelCheckpoint
from distrain.lightning._refuse import refusing


class ModelCheckpoint(_ModelCheckpoint):
    """distrain's ``ModelCheckpoint`` with Lightning's defaults and paths: ``filename`` ``{epoch}-{step}`` with each
    field's name inserted and ``.ckpt`` appended (``epoch=3-step=120.ckpt``, ``epoch=3-val_loss=0.25.ckpt``: one
    file, which ``torch.load`` opens, or a directory where the state is sharded), a name that exists already versioned
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

    def save(self, trainer) -> None:
        """Lightning writes a monitored checkpoint only where it enters the ``save_top_k`` best (or where
        ``save_last`` asks for ``last.ckpt``): the hooks of a save (``on_save_checkpoint``) run for those alone. A run
        a signal stopped is saved whatever its score."""
        scored = self.monitor is not None and self.save_top_k > 0 and not self.names_last
        if scored and trainer.preempted is None and not self._enters_top_k(self._score(trainer)):
            return
        super().save(trainer)

    def on_train_end(self, trainer, module) -> None:
        """Lightning saves nothing when training ends: the kept checkpoints are those of its epochs' ends or
        validations (a final one would take a place in ``save_top_k`` with the last validation's score). A run a
        signal stopped is saved there, so that it resumes from the step it stopped at."""
        if trainer.preempted is not None:
            super().on_train_end(trainer, module)


class TQDMProgressBar(ProgressBar):
    """Lightning's progress bar, drawn by distrain's (one bar over the fit's optimizer steps, on rank 0): moved every
    ``refresh_rate`` batches (0: no bar, as in Lightning), at ``process_position`` (tqdm's ``position``); ``leave``
    is taken, and the bar stays when the fit ends either way."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False):
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ValueError(
                f"{type(self).__name__}(refresh_rate=...) is a number of batches >= 0, got {refresh_rate!r}"
            )
        super().__init__(refresh_seconds=0.0, refresh_steps=refresh_rate, position=process_position)
        self.leave = leave

    @property
    def refresh_rate(self) -> int:
        return self.refresh_steps

    @property
    def is_enabled(self) -> bool:
        return self.refresh_steps > 0


class RichProgressBar(TQDMProgressBar):
    """Lightning's rich bar, drawn by distrain's tqdm bar (``theme`` and ``console_kwargs`` style rich's console,
    which distrain does not use)."""

    def __init__(self, refresh_rate: int = 1, leave: bool = False, theme=None, console_kwargs=None):
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self.theme, self.console_kwargs = theme, console_kwargs


class RichProgressBarTheme:
    """Lightning's theme of its rich bar (``lightning.pytorch.callbacks.progress.rich_progress``): its styles are
    taken; distrain's bar is tqdm's, which draws none of them."""

    def __init__(self, **styles):
        self.__dict__.update(styles)


class GradientAccumulationScheduler(Callback):
    """Lightning's: ``scheduling`` maps an epoch to the batches accumulated per optimizer step from that epoch on
    (``{0: 8, 4: 4, 8: 1}``; epoch 0 accumulates 1 unless given). The Trainer reads it as its
    ``accumulate_grad_batches`` (distrain's own schedule), so the two cannot both be given."""

    def __init__(self, scheduling: dict[int, int]):
        if not isinstance(scheduling, dict) or not scheduling:
            raise TypeError(
                f"GradientAccumulationScheduler(scheduling=...) is a dict of epoch → batches, got {scheduling!r}"
            )
        for epoch, batches in scheduling.items():
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise IndexError(f"GradientAccumulationScheduler: epoch {epoch!r} should be an integer >= 0")
            if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
                raise IndexError(
                    f"GradientAccumulationScheduler: accumulation factor {batches!r} of epoch {epoch} should be an "
                    "integer >= 1"
                )
        self.scheduling = {0: 1, **scheduling}
        self.epochs = sorted(self.scheduling)

    def going_to_accumulate_grad_batches(self) -> bool:
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        return self.scheduling[max(e for e in self.epochs if e <= epoch)]


class ModelSummary(Callback):
    """Lightning's: a table of the model's layers down to ``max_depth`` (-1: every one, 0: none) with their parameter
    counts, and the totals, printed on rank 0 when fit starts."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs):
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(f"ModelSummary(max_depth=...) is an integer >= -1, got {max_depth!r}")
        self.max_depth, self.summarize_kwargs = max_depth, summarize_kwargs

    def on_fit_start(self, trainer, module) -> None:
        if trainer.is_global_zero and self.max_depth != 0:
            print(summarize(module, self.max_depth), flush=True)


def summarize(module, max_depth: int = 1) -> str:
    """Lightning's model summary: the layers down to ``max_depth`` (-1: all), then the parameter totals."""

    def count(params) -> int:  # a ZeRO-3 partition counts whole
        return sum(getattr(p, "ds_numel", p.numel()) for p in params)

    rows = [
        (name, type(layer).__name__, count(layer.parameters()), "train" if layer.training else "eval")
        for name, layer in module.named_modules()
        if name and (max_depth < 0 or name.count(".") < max_depth)
    ]
    params = list(module.parameters())
    trainable = count(p for p in params if p.requires_grad)
    total = count(params)
    header = ("", "Name", "Type", "Params", "Mode")
    table = [header, *[(str(i), *row[:2], _human(row[2]), row[3]) for i, row in enumerate(rows)]]
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in table]
    rule = "-" * max(len(line) for line in lines)
    return "\n".join(
        [lines[0], rule, *lines[1:], rule]
        + [
            f"{_human(trainable):<10}Trainable params",
            f"{_human(total - trainable):<10}Non-trainable params",
            f"{_human(total):<10}Total params",
            f"{total * 4 / 1e6:<10.3f}Total estimated model params size (MB)",
        ]
    )


def _human(n: int) -> str:
    """Lightning's counts: ``65``, ``1.0 K``, ``131 K``, ``7.2 B``."""
    groups = min(math.ceil(len(str(n)) / 3), 5)
    value, label = n / 10 ** (3 * (groups - 1)), " KMBT"[groups - 1]
    return f"{int(value):,d} {label}" if groups == 1 or value >= 100 else f"{value:,.1f} {label}"


__all__ = [
    "BasePredictionWriter",
    "Callback",
    "DeviceStatsMonitor",
    "EMAWeightAveraging",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "LearningRateFinder",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "ProgressBar",
    "RichProgressBar",
    "RichProgressBarTheme",
    "StochasticWeightAveraging",
    "TQDMProgressBar",
    "Timer",
    "WeightAveraging",
]


__getattr__ = refusing(__name__)
