"""At the end of training, rank 0 draws the run's curves into ``<output_dir>/plots/summary.png``."""

from __future__ import annotations

import warnings
from pathlib import Path

from distrain.callbacks.base import Callback


class PlotSummary(Callback):
    """Draws ``distrain.plotting.plot_runs`` of this run's ``metrics.jsonl`` when training ends
    (also after a stop signal). A failure to draw never fails the run: it is reported as a
    warning. ``dirpath`` defaults to ``<trainer.log_dir>/plots``."""

    def __init__(self, dirpath: str | None = None, filename: str = "summary.png"):
        self.dirpath = dirpath
        self.filename = filename
        self.last_path: Path | None = None

    def on_train_end(self, trainer, module) -> None:
        if not trainer.is_global_zero:
            return
        from distrain.loggers import JSONLLogger

        jsonl = next((lg for lg in trainer.loggers if isinstance(lg, JSONLLogger)), None)
        if jsonl is None or not jsonl.path.is_file():
            return  # nothing was logged to draw from (the JSONL file is line-buffered: complete here)
        output = Path(self.dirpath or Path(trainer.log_dir) / "plots") / self.filename
        try:
            from distrain.plotting import plot_runs

            self.last_path = plot_runs([jsonl.path], output, labels=[Path(trainer.log_dir).name])
        except Exception as e:  # plotting is a convenience: the run's results are already written
            warnings.warn(f"distrain: could not draw {output}: {type(e).__name__}: {e}", stacklevel=2)
