"""What a step of the training loop can come to besides its output, as ``Trainer.train_step`` returns it."""

from enum import Enum


class StepOutcome(Enum):
    """A step that gave no output to go on with; ``train_step`` returns the step's output otherwise."""

    #: the strategy did not commit the step (``Strategy.commit_step``: a replica group was lost during it)
    DROPPED = "dropped"
    #: the step's data was found at fault before a rollback (``on_anomaly``): not run
    SKIPPED = "skipped"
    #: ``on_anomaly="rollback"`` loaded the newest checkpoint: read on from its position
    ROLLED_BACK = "rolled back"
    #: ``on_train_batch_start`` returned -1 (Lightning's "skip the rest of this epoch"), on some rank
    SKIP_REST_OF_EPOCH = "skip the rest of the epoch"
