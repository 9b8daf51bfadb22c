"""Llama-style causal LM on a text corpus: FSDP, activation checkpointing, packed blocks.

    # CPU, offline: a tiny Llama and a small text corpus are built in DIR first
    python examples/llama_causal_lm.py --make-tiny /tmp/tiny-hf --devices 2

    # a real model and dataset (network, or local copies of both)
    python examples/llama_causal_lm.py --model_name meta-llama/Llama-3.2-1B --dataset Salesforce/wikitext \\
        --dataset-config wikitext-2-raw-v1 --devices 8 --precision bf16-mixed --learning-rate 2e-5

This is `distrain train` with the settings printed first: the same job runs from the CLI or a YAML
config. The model is built on the meta device and each rank receives only its shards of the
pretrained weights; FSDP units and activation checkpointing use the model's own decoder layer
(`_no_split_modules`). The loss is the mean over every real token of the optimizer step, on all
ranks. The trained model is exported to `<output-dir>/hf` (`AutoModelForCausalLM.from_pretrained`).
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
    p.add_argument("--make-tiny", metavar="DIR", help="build a tiny local Llama and text corpus in DIR and use them")
    p.add_argument("--model_name", "--model-name", dest="model_name")
    p.add_argument("--dataset", help="hub name or local file/directory with a text column")
    p.add_argument("--dataset-config")
    p.add_argument("--devices", default="2")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--max-length", type=int, default=64, help="tokens per packed block")
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--output-dir", default="runs/llama_causal_lm")
    args, overrides = p.parse_known_args()

    model, dataset, lr = args.model_name, args.dataset, args.learning_rate
    if args.make_tiny:  # every rank re-runs this script: building is idempotent and atomic
        from distrain.hf import tiny

        root = Path(args.make_tiny)
        model = tiny.make_tiny_llama(root / "llama")
        dataset = str(root / "counting.txt")
        if not os.path.exists(dataset):
            tmp = f"{dataset}.{os.getpid()}"
            Path(tmp).write_text("\n".join(tiny.counting_texts(2000, seed=1)) + "\n")
            os.replace(tmp, dataset)
        lr = lr or 1e-2
    if not model or not dataset:
        p.error("give --model_name and --dataset, or --make-tiny DIR")
    argv = [
        "train",
        "--model_name",
        model,
        "--strategy",
        "fsdp",
        "--devices",
        args.devices,
        "--precision",
        args.precision,
        "--max-steps",
        str(args.max_steps),
        "--output-dir",
        args.output_dir,
        "training.task=causal_lm",
        f"training.learning_rate={lr or 2e-5}",
        "training.activation_checkpointing=true",
        "training.num_epochs=100",
        "fsdp.auto_wrap_policy=transformer_based",
        f"data.dataset={dataset}",
        "data.packing=true",
        f"data.max_length={args.max_length}",
        *([f"data.dataset_config={args.dataset_config}"] if args.dataset_config else []),
        *overrides,
    ]
    if "RANK" not in os.environ:
        print("distrain " + shlex.join(argv), flush=True)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
