"""Lightning's ``Tuner``: ``lr_find`` runs a fit that ends once the learning-rate range test has run in its ranks
(``callbacks/lr_finder.py``), and returns what the test found, the module's learning rate set to the suggestion."""

from __future__ import annotations

from distrain.callbacks.lr_finder import LearningRateFinder, LRFinder


class Tuner:
    def __init__(self, trainer):
        self._trainer = trainer

    def lr_find(
        self,
        model,
        train_dataloaders=None,
        val_dataloaders=None,
        dataloaders=None,
        datamodule=None,
        method: str = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
        weights_only: bool | None = None,
    ) -> LRFinder | None:
        """Lightning's arguments and result. Where the ranks run this script (one process, ``ddp``), each rank
        returns rank 0's results; under ``ddp_spawn``/``ddp_fork`` the search would stay in the ranks, so it is
        refused."""
        trainer = self._trainer
        if method != "fit":
            raise ValueError("method='fit' is the only valid configuration to run lr finder.")
        if dataloaders is not None:
            raise ValueError(
                "In tuner with method='fit', `dataloaders` argument should be None, please consider setting "
                "`train_dataloaders` and `val_dataloaders` instead."
            )
        if any(isinstance(cb, LearningRateFinder) for cb in trainer.callbacks):
            raise ValueError(
                "Trainer is already configured with a `LearningRateFinder` callback. Please remove it if you want "
                "to use the Tuner."
            )
        if not trainer.runtime.ranks_run_this_script:
            raise ValueError(
                "Tuner.lr_find with ranks spawned or forked from this process (ddp_spawn, ddp_fork): the search's "
                "results would stay in them; use strategy='ddp' (the ranks run this script), or the "
                "LearningRateFinder callback in the fit itself"
            )
        finder = LearningRateFinder(
            min_lr, max_lr, num_training, mode, early_stop_threshold, update_attr, attr_name, weights_only
        )
        finder.early_exit = True
        trainer.callbacks = [finder, *trainer.callbacks]
        try:
            trainer.fit(model, train_dataloaders, val_dataloaders, datamodule)
        finally:
            trainer.callbacks = [cb for cb in trainer.callbacks if cb is not finder]
        return finder.optimal_lr

    def scale_batch_size(self, *args, **kwargs):
        raise NotImplementedError(
            "Tuner.scale_batch_size: distrain has no batch-size search; `distrain plan` (or strategy='auto') gives "
            "the largest micro-batch that fits each strategy's memory, before any rank starts (docs/planner.md)"
        )
