"""Hugging Face models and datasets: tiny local models (no download), real gloo ranks, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from helpers import make_trainer, run_cli, run_ranks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny Llama and BERT directories with their tokenizers, and small local datasets."""
    from distrain.hf import tiny

    root = tmp_path_factory.mktemp("hf")
    texts = tiny.counting_texts(64, seed=1)
    (root / "counting.txt").write_text("\n".join(texts) + "\n")
    return {
        "root": root,
        "llama": tiny.make_tiny_llama(root / "llama"),
        "bert": tiny.make_tiny_bert(root / "bert"),
        "counting": str(root / "counting.txt"),
        "reviews_train": tiny.write_jsonl(root / "reviews_train.jsonl", tiny.reviews(160, seed=2)),
        "reviews_eval": tiny.write_jsonl(
            root / "reviews_eval.jsonl", tiny.reviews(21, seed=3)
        ),  # odd: 11 + 10 on 2 ranks
    }


def _cli(*args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "distrain.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, **OFFLINE, **(env or {})},
    )


# ---- data ------------------------------------------------------------------------------------
def test_local_datasets_load_and_hub_names_offline_fail_clearly(tiny, tmp_path):
    import pandas as pd

    from distrain.config import ConfigError, DataConfig
    from distrain.hf import data as hf_data
    from distrain.hf.models import load_tokenizer
    from distrain.hf.tiny import reviews

    rows = reviews(30, seed=4)
    (tmp_path / "r.csv").write_text(pd.DataFrame(rows).to_csv(index=False))
    pd.DataFrame(rows).to_parquet(tmp_path / "r.parquet")
    tok = load_tokenizer(tiny["bert"])
    cache = str(tmp_path / "cache")
    for path in (tiny["reviews_train"], tmp_path / "r.csv", tmp_path / "r.parquet"):
        raw = hf_data.load_raw(str(path), cache_dir=cache)
        assert raw.column_names == ["text", "label"] and len(raw) in (160, 30), path
        cfg = DataConfig(dataset=str(path), eval_split=tiny["reviews_eval"], max_length=8)
        p = hf_data.prepare(cfg, tok, "sequence_classification", cache_dir=cache)
        assert len(p.eval) == 21 and p.num_labels == 2
        assert max(len(s["input_ids"]) for s in p.train) == 8  # truncated to max_length
        assert p.train[0]["input_ids"][0] == tok.cls_token_id  # the model's own tokenizer ran
    # text file: one sample per non-empty line; packing cuts equal blocks of max_length tokens
    llama_tok = load_tokenizer(tiny["llama"])
    plain = hf_data.prepare(
        DataConfig(dataset=tiny["counting"], max_length=16), llama_tok, "causal_lm", cache_dir=cache
    )
    assert len(plain.train) + len(plain.eval) == 64
    assert len({len(s["input_ids"]) for s in plain.train}) > 3  # uneven lengths, padded per batch later
    packed = hf_data.prepare(
        DataConfig(dataset=tiny["counting"], max_length=16, packing=True), llama_tok, "causal_lm", cache_dir=cache
    )
    assert {len(s["input_ids"]) for s in packed.train} == {16}
    batch = hf_data.collator(DataConfig(), llama_tok)([plain.train[0], plain.train[1]])
    assert batch["attention_mask"].sum().item() == len(plain.train[0]["input_ids"]) + len(plain.train[1]["input_ids"])
    with pytest.raises(ConfigError, match="data.text_column.*'review'"):
        hf_data.prepare(
            DataConfig(dataset=tiny["reviews_train"], text_column="review"),
            tok,
            "sequence_classification",
            cache_dir=cache,
        )
    with pytest.raises(ConfigError, match="no such file"):
        hf_data.load_raw("./missing/data.jsonl")

    # hub names without network: one line that names the key and says to use a local path
    proc = _cli("train", "--model_name", "some-org/some-model", "--devices", "1", "--output-dir", str(tmp_path / "o"))
    assert proc.returncode == 2, proc.stderr
    assert "training.model_name" in proc.stderr and "some-org/some-model" in proc.stderr
    assert "local directory" in proc.stderr and proc.stderr.strip().count("\n") == 0, proc.stderr
    proc = _cli(
        "train",
        "--model_name",
        tiny["bert"],
        "--devices",
        "1",
        "--output-dir",
        str(tmp_path / "o"),
        "data.dataset=some-org/some-reviews",
        env={"HF_DATASETS_CACHE": cache},
    )
    assert proc.returncode == 2, proc.stderr
    assert "data.dataset" in proc.stderr and "some-org/some-reviews" in proc.stderr and "local" in proc.stderr
    assert not (tmp_path / "o" / "checkpoints").exists()
    # data that cannot be, told before the plan and the ranks, in one line: the built-in byte corpus (the default)
    # under a Hugging Face model, and a dataset or evaluation file written as a path that is not there
    for items, said in (
        ((), "data.dataset: the built-in corpus (builtin:stdlib"),
        (("data.dataset=./missing/data.jsonl",), "data.dataset: no such file or directory: './missing/data.jsonl'"),
        ((f"data.dataset={tiny['counting']}", "data.eval_split=/no/eval.txt"), "data.eval_split: no such file"),
    ):
        proc = run_cli(["train", "--model_name", tiny["llama"], "--output-dir", str(tmp_path / "never"), *items])
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and said in proc.stderr, (items, proc.stderr)
        assert "strategy" not in proc.stdout + proc.stderr  # nothing was planned
    assert not (tmp_path / "never").exists()


# ---- causal LM: FSDP + activation checkpointing on 2 ranks == one process; export ---------------
STEPS, GLOBAL_BATCH = 4, 8


def _fit_llama(tmp, tiny, strategy, devices, accumulate, low_precision_norms=False):
    """Fit the tiny Llama on uneven-length texts (batches padded to their longest sample). ``low_precision_norms``:
    its RMSNorms replaced (``distrain.models.norms``), in fp32 the same operations as Hugging Face's own."""
    from torch.utils.data import DataLoader

    from distrain.config import DataConfig
    from distrain.hf import data as hf_data
    from distrain.hf.models import load_tokenizer
    from distrain.hf.tasks import CausalLMModule

    blocks = None
    if strategy != "single":  # the classes the CLI derives from the model's _no_split_modules
        from distrain.hf import models
        from distrain.strategies.layers import block_classes

        blocks = block_classes(models.build_skeleton("causal_lm", models.load_config(tiny["llama"])))
        assert [c.__name__ for c in blocks] == ["LlamaDecoderLayer"]
    trainer, rec = make_trainer(
        tmp,
        strategy=strategy,
        devices=devices,
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=1e6,
        logger=False,
        activation_checkpointing_policy=blocks,
    )
    trainer.runtime.launch()  # the process group first: rank 0 tokenizes, the others read its cache
    tok = load_tokenizer(tiny["llama"])
    data = DataConfig(dataset=tiny["counting"], max_length=16, val_fraction=0.23)  # 15 eval samples: 8 + 7
    p = hf_data.prepare(data, tok, "causal_lm", seed=0, runtime=trainer.runtime, cache_dir=str(tmp / "cache"))
    collate = hf_data.collator(data, tok)
    hparams = dict(learning_rate=1e-2, warmup_steps=0, lr_schedule="constant", low_precision_norms=low_precision_norms)
    module = CausalLMModule(tiny["llama"], **hparams)
    per_rank = GLOBAL_BATCH // (devices * accumulate)
    trainer.fit(
        module,
        DataLoader(p.train, batch_size=per_rank, shuffle=True, collate_fn=collate),
        DataLoader(p.eval, batch_size=7, collate_fn=collate),
    )  # 2 batches on rank 0, 1 on rank 1
    probe = collate([p.eval[i] for i in range(4)])
    with torch.no_grad():
        logits = trainer.model("predict_step", probe, 0) if trainer.model is not None else module.predict_step(probe, 0)
    wrapped = any("CheckpointWrapper" in type(m).__name__ for m in module.modules())
    return {
        "losses": rec.losses,
        "norms": rec.grad_norms,
        "val_loss": trainer.callback_metrics["val_loss"],
        "val_tokens": trainer.callback_metrics["val_tokens"],
        "eval_targets": sum(len(s["input_ids"]) - 1 for s in p.eval),
        "logits": logits.detach().cpu(),
        "probe": probe,
        "from_cache": p.from_cache,
        "ac": wrapped,
        "norms_replaced": sum(type(m).__name__ == "LowPrecisionNorm" for m in module.modules()),
        "ckpt": str(trainer.checkpoint_callback.last_model_path),
    }


def _fsdp_rank(rank, tmp, tiny):
    return _fit_llama(tmp, tiny, "fsdp", 2, accumulate=2, low_precision_norms=True)


@pytest.mark.slow
def test_llama_fsdp_activation_checkpointing_matches_one_process_and_exports(tiny, tmp_path):
    ref = _fit_llama(tmp_path / "single", tiny, "single", 1, accumulate=4)
    ranks = run_ranks(_fsdp_rank, 2, tmp_path / "fsdp", tiny)
    fsdp = ranks[0]
    assert [r["from_cache"] for r in ranks] == [False, True]  # tokenized once, by rank 0
    assert fsdp["ac"] and not ref["ac"]
    # FSDP's model runs low-precision norms (5: two per layer and the final one), the reference Hugging Face's own:
    # in fp32 the same operations, so the same losses, and the export loads into Hugging Face's own norms
    assert fsdp["norms_replaced"] == 5 and ref["norms_replaced"] == 0
    assert len(fsdp["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0]
    # the micro-batches hold different numbers of real tokens: a per-micro-batch mean would differ
    for name in ("losses", "norms"):
        for a, b in zip(ref[name], fsdp[name], strict=True):
            assert abs(a - b) <= 1e-5 * abs(a), (name, ref[name], fsdp[name])
    assert abs(ref["val_loss"] - fsdp["val_loss"]) <= 1e-5 * ref["val_loss"]
    assert fsdp["val_tokens"] == ref["val_tokens"] == ref["eval_targets"]  # every eval token once, over both ranks
    torch.testing.assert_close(fsdp["logits"], ref["logits"], rtol=1e-4, atol=1e-4)

    # export from the sharded FSDP checkpoint: from_pretrained gives the trained model's logits
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distrain import cli
    from distrain.checkpoint.state import is_sharded_checkpoint

    assert is_sharded_checkpoint(Path(fsdp["ckpt"]))
    # the checkpoint names a local tokenizer directory: a path from a checkpoint is not followed unless the user says so
    with pytest.warns(UserWarning, match="names the local tokenizer"):
        assert cli.main(["convert", fsdp["ckpt"], str(tmp_path / "bare"), "--to", "hf"]) == 0
    assert "tokenizer.json" not in os.listdir(tmp_path / "bare")
    out = tmp_path / "hf"
    assert cli.main(["convert", fsdp["ckpt"], str(out), "--to", "hf", "--tokenizer", str(tiny["llama"])]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    probe = fsdp["probe"]
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    torch.testing.assert_close(logits, fsdp["logits"], rtol=1e-5, atol=1e-5)
    assert (
        AutoTokenizer.from_pretrained(out)("one two").input_ids
        == AutoTokenizer.from_pretrained(tiny["llama"])("one two").input_ids
    )


def _zero3_rank(rank, tmp, tiny):
    # low-precision norms found under zero.Init too, where each weight is a partition (its shape in ds_shape)
    return _fit_llama(tmp, tiny, "deepspeed_stage_3", 2, accumulate=2, low_precision_norms=True)


@pytest.mark.slow
def test_llama_zero3_matches_one_process_and_exports(tiny, tmp_path):
    """Built under zero.Init (partitioned as built, weights gathered in once), trained with the
    global token-count loss, exported from the engine's ZeRO-3 partitions."""
    pytest.importorskip("deepspeed")
    ref = _fit_llama(tmp_path / "single", tiny, "single", 1, accumulate=4)
    zero3 = run_ranks(_zero3_rank, 2, tmp_path / "zero3", tiny)[0]
    assert zero3["norms_replaced"] == 5
    # Same pretrained weights gathered in, and the same first gradient (its norm: Adam would hide a
    # wrong gradient scale from the losses): both agree to fp32 rounding. Later steps: ZeRO-3
    # reduce-scatters every micro-step into flat partitions (another summation order), and Adam at
    # lr 1e-2 amplifies that rounding a little (measured: 1e-5 by step 4, 1.1e-4 on val_loss).
    assert abs(ref["losses"][0] - zero3["losses"][0]) <= 1e-6 * ref["losses"][0]
    assert abs(ref["norms"][0] - zero3["norms"][0]) <= 1e-6 * ref["norms"][0]
    for a, b in zip(
        ref["losses"] + ref["norms"] + [ref["val_loss"]],
        zero3["losses"] + zero3["norms"] + [zero3["val_loss"]],
        strict=True,
    ):
        assert abs(a - b) <= 3e-4 * abs(a), (ref, zero3)
    torch.testing.assert_close(zero3["logits"], ref["logits"], rtol=1e-3, atol=1e-3)

    from transformers import AutoModelForCausalLM

    from distrain import cli

    assert (Path(zero3["ckpt"]) / "deepspeed").is_dir()
    out = tmp_path / "hf"
    assert cli.main(["convert", zero3["ckpt"], str(out), "--to", "hf"]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    probe = zero3["probe"]
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    torch.testing.assert_close(logits, zero3["logits"], rtol=1e-5, atol=1e-5)


# ---- sequence classification through the CLI on 2 ranks -------------------------------------------
@pytest.mark.slow
def test_bert_classification_cli_two_ranks(tiny, tmp_path):
    out = tmp_path / "run"
    proc = _cli(
        "train",
        "--model_name",
        tiny["bert"],
        "--devices",
        "2",
        "--strategy",
        "ddp",
        "--max-steps",
        "40",
        "--output-dir",
        str(out),
        f"data.dataset={tiny['reviews_train']}",
        f"data.eval_split={tiny['reviews_eval']}",
        "data.max_length=16",
        "training.batch_size_per_gpu=8",
        "training.learning_rate=1e-2",
        "training.val_check_interval=20",
        "training.warmup_ratio=0.0",
        "training.num_epochs=10",
        "logging.log_every_n_steps=5",
        "logging.progress_bar=false",
        "logging.use_tensorboard=false",
        env={"HF_DATASETS_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert sum(losses[-2:]) / 2 < 0.8 * sum(losses[:2]) / 2, losses  # it learns
    evals = [r for r in records if "val_acc" in r]
    assert [r["step"] for r in evals] == [20, 40]  # one report per validation, not one per rank
    for r in evals:
        assert r["val_samples"] == 21  # 11 + 10 samples on the 2 ranks, each counted once, no padding duplicates
    # the exported model reproduces the reported accuracy on the whole eval set
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from distrain.hf.tiny import reviews

    model = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    rows = reviews(21, seed=3)
    with torch.no_grad():
        enc = tok([r["text"] for r in rows], padding=True, truncation=True, max_length=16, return_tensors="pt")
        pred = model(**enc).logits.argmax(-1)
    accuracy = (pred == torch.tensor([r["label"] for r in rows])).float().mean().item()
    assert abs(accuracy - evals[-1]["val_acc"]) < 1e-6, (accuracy, evals[-1])
    assert evals[-1]["val_acc"] > 0.7, evals
