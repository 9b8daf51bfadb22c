"""What a step of the training loop can come to besides its output, as ``Trainer.train_step`` returns it."""

#: what ``train_step`` returns for a step the strategy did not commit (``Strategy.commit_step``)
DROPPED = object()
#: what ``train_step`` returns for a step whose data was found at fault before a rollback (``on_anomaly``): not run
SKIPPED = object()
#: what ``train_step`` returns when ``on_anomaly="rollback"`` loaded the newest checkpoint: read on from its position
ROLLED_BACK = object()
#: ``on_train_batch_start`` returned -1 (Lightning's "skip the rest of this epoch"), on some rank
SKIP_REST_OF_EPOCH = object()
