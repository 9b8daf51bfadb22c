"""BERT-style sequence classification on reviews: train loss, eval loss and accuracy over all ranks.

    # CPU, offline: a tiny BERT and a synthetic review set are built in DIR first
    python examples/bert_classification.py --make-tiny /tmp/tiny-hf --devices 2

    # a real model and dataset (network, or local copies of both)
    python examples/bert_classification.py --model_name google-bert/bert-base-uncased --dataset stanfordnlp/imdb \\
        --eval-split test --devices 8 --precision bf16-mixed --learning-rate 2e-5

This is `distrain train` with the settings printed first: the same job runs from the CLI or a YAML
config. Extra `key=value` arguments pass through (e.g. `training.batch_size_per_gpu=32`).
The trained model is exported to `<output-dir>/hf` (`AutoModelForSequenceClassification.from_pretrained`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from distrain import cli


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--make-tiny", metavar="DIR", help="build a tiny local BERT and review dataset in DIR and use them")
    p.add_argument("--model_name", "--model-name", dest="model_name")
    p.add_argument("--dataset", help="hub name or local file/directory with text and label columns")
    p.add_argument("--eval-split", help="a split name (test, validation) or a local file")
    p.add_argument("--devices", default="2")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--output-dir", default="runs/bert_classification")
    args, overrides = p.parse_known_args()

    model, dataset, eval_split, lr = args.model_name, args.dataset, args.eval_split, args.learning_rate
    if args.make_tiny:  # every rank re-runs this script: building is idempotent and atomic
        from distrain.hf import tiny

        root = Path(args.make_tiny)
        model = tiny.make_tiny_bert(root / "bert")
        dataset = _once(root / "reviews_train.jsonl", lambda path: tiny.write_jsonl(path, tiny.reviews(2000, seed=1)))
        eval_split = _once(root / "reviews_eval.jsonl", lambda path: tiny.write_jsonl(path, tiny.reviews(201, seed=2)))
        lr = lr or 1e-2  # a 32-wide model from scratch wants a large step
    if not model or not dataset:
        p.error("give --model_name and --dataset, or --make-tiny DIR")
    argv = [
        "train",
        "--model_name",
        model,
        "--strategy",
        args.strategy,
        "--devices",
        args.devices,
        "--precision",
        args.precision,
        "--max-steps",
        str(args.max_steps),
        "--output-dir",
        args.output_dir,
        "training.task=sequence_classification",
        f"training.learning_rate={lr or 2e-5}",
        "training.num_epochs=100",
        f"data.dataset={dataset}",
        "data.text_column=text",
        "data.label_column=label",
        "data.max_length=128",
        *([f"data.eval_split={eval_split}"] if eval_split else []),
        *overrides,
    ]
    if "RANK" not in os.environ:
        print("distrain " + shlex.join(argv), flush=True)
    return cli.main(argv)


def _once(path: Path, write) -> str:
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        write(tmp)
        os.replace(tmp, path)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
