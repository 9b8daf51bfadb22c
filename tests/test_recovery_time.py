"""A run that resumes (or a rank torchrun restarted) says how long it took to train again, in parts, so the
seconds a recovery costs can be seen and cut (``distrain/training/startup.py``; benchmarks/recovery.py)."""

import re

import pytest

from helpers import TinyGPT, loader, make_trainer

pytestmark = pytest.mark.alone  # it times the parts of a restart (tests/conftest.py)

LINE = re.compile(r"distrain: training again at step (\d+), ([\d.]+) s after the process started: (.*)")


def test_a_resumed_fit_names_the_parts_of_its_start(tmp_path, capsys):
    trainer, _ = make_trainer(tmp_path, devices=1, max_steps=2, logger=False)
    trainer.fit(TinyGPT(), loader(4))
    assert not LINE.search(capsys.readouterr().out)  # a fresh start is not a recovery
    trainer, _ = make_trainer(tmp_path, devices=1, max_steps=3, logger=False)
    trainer.fit(TinyGPT(), loader(4), ckpt_path="last")
    found = LINE.search(capsys.readouterr().out)
    assert found and found.group(1) == "3"
    parts = [re.fullmatch(r"(.+) ([\d.]+) s", p).groups() for p in found.group(3).split(", ")]
    names = [name for name, _ in parts]
    assert names[0] == "imports and config" and names[-2:] == ["checkpoint read", "first step"]
    total = sum(float(seconds) for _, seconds in parts)
    assert abs(total - float(found.group(2))) <= 0.1 * len(parts)  # the parts add up to the whole
