"""Credentials in config values (a URL's ``user:token@``, ``?token=``, a key named like ``api_key``) never reach
what a run writes or prints: config.yaml, checkpoints, the trackers' parameters, the console. The run itself uses
the real values."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import torch
import yaml

from distrain.config import build_config, redact_text, redacted, save_config

SECRETS = ("S3cretUserTok", "S3cretQueryTok", "S3cretApiKey", "S3cretSig")


def test_redact_text_covers_the_class():
    cases = {
        "https://alice:S3cretUserTok@mlflow.example.com/x": "https://***@mlflow.example.com/x",
        "http://S3cretUserTok@host:5000": "http://***@host:5000",
        "postgresql://u:S3cretUserTok@db/mlflow": "postgresql://***@db/mlflow",
        "https://h/p?a=1&access_token=S3cretQueryTok&b=2": "https://h/p?a=1&access_token=***&b=2",
        "s3://b/k?X-Amz-Signature=S3cretSig&X-Amz-Credential=c&x=1": "s3://b/k?X-Amz-Signature=***&X-Amz-Credential=***&x=1",
        "https://h/?sig=S3cretSig#frag": "https://h/?sig=***#frag",
        "sqlite:///mlflow.db": "sqlite:///mlflow.db",  # nothing secret: unchanged
        "gpt2": "gpt2",
        "user@example.com": "user@example.com",  # not a URL
        "https://h/?keyboard=azerty": "https://h/?keyboard=azerty",  # a word of the name must be a secret word
    }
    for text, expected in cases.items():
        assert redact_text(text) == expected, text
        assert redact_text(expected) == expected  # twice is once


def test_redacted_is_a_copy_and_the_run_keeps_the_real_values(tmp_path):
    uri = "https://alice:S3cretUserTok@mlflow.example.com/?token=S3cretQueryTok"
    config = build_config(
        cli_items=[f"logging.mlflow_tracking_uri={uri}", "training.module_args={api_key: S3cretApiKey}"]
    )
    tree = redacted(config.to_dict())
    assert tree["logging"]["mlflow_tracking_uri"] == "https://***@mlflow.example.com/?token=***"
    assert tree["training"]["module_args"] == {"api_key": "***"}
    assert tree["data"]["tokenizer"] is None and tree["data"]["dataset"] == "builtin:stdlib"  # the rest as it was
    save_config(config, tmp_path / "config.yaml")
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["logging"]["mlflow_tracking_uri"].startswith(
        "https://***@"
    )
    assert config.logging.mlflow_tracking_uri == uri and config.training.module_args == {"api_key": "S3cretApiKey"}

    from distrain.trainer import Trainer

    trainer = Trainer(accelerator="cpu", devices=1, strategy="single", logger=False, enable_progress_bar=False)
    trainer.run_config = config.to_dict()  # what the jobs give it: checkpoints and loggers get it redacted
    assert trainer.run_config["logging"]["mlflow_tracking_uri"] == tree["logging"]["mlflow_tracking_uri"]
    assert config.logging.mlflow_tracking_uri == uri


def _distrain(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "distrain.cli", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300
    )


def test_no_secret_in_any_file_of_a_run_or_its_output(tmp_path):
    """A real run (and its resume) with credentials in URL-valued keys, TensorBoard, checkpoints and — when
    installed — MLflow logging to a store inside the run directory whose URI carries a token."""
    run = tmp_path / "run"
    if importlib.util.find_spec("mlflow") is not None:  # the tracker really uses this URI: a token in its query
        tracker = [
            "logging.use_mlflow=true",
            f"logging.mlflow_tracking_uri=sqlite:///file:{run}/mlflow.db?mode=rwc&token=S3cretQueryTok&uri=true",
        ]
    else:
        tracker = ["logging.mlflow_tracking_uri=https://alice:S3cretUserTok@mlflow.example.com/?token=S3cretQueryTok"]
    common = [
        "--output-dir",
        str(run),
        "--strategy",
        "single",
        "--devices",
        "1",
        "data.seq_len=16",
        "data.max_bytes=20000",
        "training.batch_size_per_gpu=4",
        "logging.progress_bar=false",
        "logging.log_every_n_steps=1",
        "logging.plot_summary=false",
        "checkpointing.save_every_n_steps=2",
        "training.val_check_interval=2",
        "training.limit_val_batches=1",
        # URL-valued keys this run does not use (the lighthouse is ddp_torchft's), still in its config
        "distributed.lighthouse=http://bob:S3cretUserTok@127.0.0.1:29510",
        "training.module_args={api_key: S3cretApiKey, url: 'https://h/x?sig=S3cretSig'}",
        *tracker,
    ]
    outputs = []
    printed = _distrain("train", *common, "--print-config", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr[-3000:]
    assert "***" in printed.stdout
    outputs.append(printed.stdout + printed.stderr)
    for steps, resume in ((4, []), (6, ["--resume", "last"])):
        proc = _distrain("train", "--max-steps", str(steps), *resume, *common, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        # the resumed MLflow run compares its parameters with the new ones: both redacted, only max_steps changed
        kept = [line for line in proc.stderr.splitlines() if "keeps its first values" in line]
        assert all("values of training.max_steps (" in line for line in kept), kept
        outputs.append(proc.stdout + proc.stderr)

    files = [p for p in run.rglob("*") if p.is_file()]
    assert (run / "config.yaml") in files and any(p.name == "state.pt" for p in files)
    assert any("tfevents" in p.name for p in files)
    for path in files:
        data = path.read_bytes()
        leaked = [s for s in SECRETS if s.encode() in data]
        assert not leaked, f"{path.relative_to(run)} holds {leaked}"
    for text in outputs:
        assert not [s for s in SECRETS if s in text], text[-3000:]

    written = yaml.safe_load((run / "config.yaml").read_text())
    assert written["distributed"]["lighthouse"] == "http://***@127.0.0.1:29510"
    state = torch.load(run / "checkpoints" / "last" / "state.pt", weights_only=True)
    assert state["progress"]["global_step"] == 6
    assert state["config"]["training"]["module_args"] == {"api_key": "***", "url": "https://h/x?sig=***"}
    assert "token=***" in state["config"]["logging"]["mlflow_tracking_uri"]
