"""W&B and MLflow for real, offline: a 2-rank run logs through rank 0 only, and a job resumed from
its checkpoint (here on 1 rank) continues the same tracker run instead of starting a new one."""

import glob
import json
import os
import struct
import zlib
from pathlib import Path

import pytest

import distrain
from helpers import TinyGPT, loader, make_trainer, run_ranks

FIRST, TOTAL = 3, 5  # steps before the stop, and in all


def _fit(rank, tmp, make_logger, max_steps, resume):
    os.environ.update(WANDB_SILENT="true", WANDB_CONSOLE="off")
    logger = make_logger(tmp)
    trainer, _ = make_trainer(
        tmp,
        strategy="ddp" if int(os.environ["WORLD_SIZE"]) > 1 else "single",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=max_steps,
        logger=[logger],
        callbacks=[distrain.ModelCheckpoint(every_n_train_steps=FIRST)],
        enable_plots=False,
    )
    trainer.run_config = {"training": {"learning_rate": 0.003, "max_steps": max_steps}}
    trainer.fit(TinyGPT(), loader(4), ckpt_path="last" if resume else None)
    return logger.state_dict()


def _stop_and_resume(tmp, make_logger):
    first = run_ranks(_fit, 2, str(tmp), make_logger, FIRST, False)
    (resumed,) = run_ranks(_fit, 1, str(tmp), make_logger, TOTAL, True)
    return first, resumed


# ---- Weights & Biases ---------------------------------------------------------------------------


def _wandb_logger(tmp):
    return distrain.loggers.WandbLogger(project="distrain-test", save_dir=tmp, mode="offline")


def _run_file_records(path):
    """The serialized records of a W&B offline run file (the file `wandb sync` uploads): LevelDB's log
    format (google/leveldb doc/log_format.md: 32 KiB blocks of records with a crc32, length and type
    header) after a 7-byte ``:W&B`` header. W&B has no public reader, and its Python one
    (``wandb.sdk.internal.datastore``) is gone since 0.31, whose Go core writes the same format."""
    block, header = 32768, 7
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", path
    i, pending = header, b""
    while i + header <= len(data):
        if block - i % block < header:  # a block ends in zero padding
            i += block - i % block
            continue
        checksum, length, kind = struct.unpack_from("<IHB", data, i)
        chunk = data[i + header : i + header + length]
        i += header + length
        assert checksum == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"{path}: corrupt record before byte {i}"
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST start a record; MIDDLE, LAST extend it
        if kind in (1, 4):  # FULL, LAST end it
            yield pending


def _wandb_records(run_file):
    """History rows and config updates from an offline run file (W&B's record protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb

    history, config = [], {}
    for data in _run_file_records(run_file):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append({**row, "_step": record.history.step.num})
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update({u.key or ".".join(u.nested_key): json.loads(u.value_json) for u in updates})
    return history, config


@pytest.mark.slow
def test_wandb_offline_history_config_and_resume(tmp_path):
    pytest.importorskip("wandb", reason="the test extra installs wandb")

    first, resumed = _stop_and_resume(tmp_path, _wandb_logger)
    run_id = first[0]["id"]
    assert resumed["id"] == run_id  # the checkpoint carried rank 0's run id
    run_dirs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    # one W&B run written per job (rank 1 wrote nothing), both under the same id
    assert len(run_dirs) == 2 and all(d.endswith(f"-{run_id}") for d in run_dirs), run_dirs
    steps, losses = [], {}
    for d in run_dirs:
        history, config = _wandb_records(str(Path(d) / f"run-{run_id}.wandb"))
        assert config["training"]["learning_rate"] == 0.003
        for row in history:
            steps.append(row["_step"])
            losses[row["_step"]] = row["loss"]
    assert sorted(set(steps)) == list(range(1, TOTAL + 1))
    assert all(0 < v < 10 for v in losses.values())


# ---- MLflow -------------------------------------------------------------------------------------


def _mlflow_logger(tmp):
    return distrain.loggers.MLFlowLogger(experiment_name="distrain-test", tracking_uri=f"sqlite:///{tmp}/mlflow.db")


@pytest.mark.slow
def test_mlflow_sqlite_metrics_params_and_resume(tmp_path):
    mlflow = pytest.importorskip("mlflow", reason="the test extra installs mlflow")

    first, resumed = _stop_and_resume(tmp_path, _mlflow_logger)
    assert resumed["run_id"] == first[0]["run_id"]
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    runs = mlflow.search_runs(experiment_names=["distrain-test"])
    assert len(runs) == 1  # rank 1 created no run; the resumed job created none either
    run = runs.iloc[0]
    assert run["run_id"] == first[0]["run_id"] and run["status"] == "FINISHED"
    assert run["params.training.learning_rate"] == "0.003"
    assert run["params.training.max_steps"] == str(FIRST)  # MLflow parameters keep their first value
    assert 0 < run["metrics.loss"] < 10
    history = mlflow.tracking.MlflowClient().get_metric_history(run["run_id"], "loss")
    assert sorted(m.step for m in history) == list(range(1, TOTAL + 1))
