"""How long a checkpoint save to object storage stalls training, against one to the local disk, and how fast the
checkpoint goes up.

    python benchmarks/remote_save.py [--width 2048 --layers 4 --steps 36 --every 12] [--url s3://bucket/prefix]

One process on the CPU, an MLP (4 × 2048²: 17M parameters, 200 MB with AdamW's state), ``--steps`` steps with
``ModelCheckpoint(every_n_train_steps=--every, save_top_k=1)``. Three runs: no checkpoints (the step time), a local
directory, and an ``s3://`` URL: by default a moto S3 server started here on loopback (``pip install
'moto[server]' s3fs``, the test extra), or the endpoint of the environment (``AWS_ENDPOINT_URL``) with ``--url``.

The stall of a save is the time the loop spends in ``ModelCheckpoint.save``: the local write, and for the URL
whatever of the previous upload the steps between did not hide (uploads go up in the background, one at a time).
``end`` is the wait for the last upload when fit ends. The upload rate is the bytes each upload sent over the time
it took, in its own thread, while training ran beside it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import socket
import subprocess
import sys
import tempfile
import time

import torch
from async_save import MLP  # the local save benchmark's model (this script's folder is on sys.path)
from torch.utils.data import DataLoader, TensorDataset

import distrain


class TimedCheckpoint(distrain.ModelCheckpoint):
    """``ModelCheckpoint`` with the time of each save and of the wait at the end of fit."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stalls: list[float] = []
        self.end = 0.0

    def save(self, trainer) -> None:
        start = time.perf_counter()
        super().save(trainer)
        self.stalls.append(time.perf_counter() - start)

    def on_fit_end(self, trainer, module) -> None:
        start = time.perf_counter()
        super().on_fit_end(trainer, module)
        self.end = time.perf_counter() - start


def run(dirpath: str | None, args) -> tuple[float, TimedCheckpoint | None]:
    with tempfile.TemporaryDirectory(dir=".") as root:
        checkpoint = TimedCheckpoint(dirpath=dirpath, every_n_train_steps=args.every) if dirpath else None
        trainer = distrain.Trainer(
            accelerator="cpu",
            strategy="single",
            devices=1,
            max_steps=args.steps,
            callbacks=[checkpoint] if checkpoint else [],
            enable_checkpointing=checkpoint is not None,
            logger=False,
            enable_progress_bar=False,
            enable_plots=False,
            default_root_dir=root,
        )
        data = DataLoader(TensorDataset(torch.randn(args.steps * 8, args.width)), batch_size=8)
        start = time.perf_counter()
        trainer.fit(MLP(args.width, args.layers), data)
        return time.perf_counter() - start, checkpoint


def moto_server() -> str:
    """A moto S3 server on loopback, in a process of its own (in this one it would hold the GIL against the
    training), with a bucket ``bench``; the URL to write to."""
    import s3fs

    from distrain.cluster import find_free_port

    port = find_free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    atexit.register(server.terminate)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",  # noqa: S105 — moto's, on loopback
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    deadline = time.monotonic() + 30
    while server.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:  # not listening yet
            time.sleep(0.2)
            continue
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")
        return "s3://bench/run"
    raise SystemExit(f"the moto server did not start (python -m moto.server: exit code {server.poll()})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--every", type=int, default=12)
    parser.add_argument("--url", help="an s3:// (or other fsspec) URL to write to; default: a moto server here")
    args = parser.parse_args()
    params = args.layers * (args.width**2 + args.width)
    print(
        f"MLP {args.layers} × {args.width}²: {params / 1e6:.0f}M parameters, {params * 12 / 2**20:.0f} MiB with AdamW"
    )
    url = args.url or moto_server()
    with tempfile.TemporaryDirectory(dir=".") as local:
        bare, _ = run(None, args)
        rows = {"local disk": run(f"{local}/checkpoints", args), url: run(url, args)}
    step = bare / args.steps
    print(f"no checkpoints: {bare:.1f}s, {step:.2f}s a step")
    print(
        f"{'to':>24} | {'saves':>5} | {'stall a save':>12} | {'÷ step':>6} | {'end':>6} | {'run':>6} | {'upload':>10}"
    )
    for name, (total, cb) in rows.items():
        stall = sum(cb.stalls) / len(cb.stalls)
        rate = f"{cb.uploads.bytes / cb.uploads.seconds / 2**20:.0f} MiB/s" if cb.uploads.seconds else "-"
        print(
            f"{name:>24} | {len(cb.stalls):>5} | {stall:>11.2f}s | {stall / step:>6.2f} | {cb.end:>5.2f}s | "
            f"{total:>5.1f}s | {rate:>10}"
        )
    local_stall = sum(rows["local disk"][1].stalls) / len(rows["local disk"][1].stalls)
    remote_stall = sum(rows[url][1].stalls) / len(rows[url][1].stalls)
    print(f"stall a save, object storage / local disk: {remote_stall / local_stall:.2f}x")


if __name__ == "__main__":
    main()
