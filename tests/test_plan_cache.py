"""The plan's decisions are kept between starts of the same run (``distrain/planner/cache.py``): the same inputs
skip the plan, any changed input plans again, and a kept file is read as untrusted bytes."""

import json
import os
import sys

import pytest

from distrain.config import build_config
from distrain.planner import cache, decide, from_config, machine, plan
from distrain.planner.decide import Decision
from distrain.planner.decide import for_config as decide_for_training


@pytest.fixture
def planned(monkeypatch, tmp_path):
    """Counts the plans really made (the trace and the timing are another test's business)."""
    monkeypatch.setenv("DISTRAIN_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.delenv("DISTRAIN_PLANNED", raising=False)
    calls = []

    def planned(config, job):
        calls.append(config.distributed.devices)
        return Decision("fsdp", sharding="SHARD_GRAD_OP", accumulate=2, messages=["distrain: strategy auto → fsdp"])

    monkeypatch.setattr(decide, "_planned", planned)
    return calls


def _config(*items):
    return build_config(None, {}, ["distributed.accelerator=cpu", "distributed.devices=2", *items])


def _key(config) -> str:
    gpu = from_config.plans_for_gpu(config)
    per_node = from_config.ranks_per_node(config, gpu)
    return cache.key(config, from_config.budget_from_config(config, gpu, per_node), per_node)


def test_the_same_run_started_again_takes_the_kept_decision_without_planning(planned, tmp_path):
    first = decide_for_training(_config("output_dir=/tmp/a"))
    again = decide_for_training(_config("output_dir=/tmp/b"))  # where the files go is not an input
    assert planned == [2]
    assert (again.strategy, again.sharding, again.accumulate) == ("fsdp", "SHARD_GRAD_OP", 2)
    assert again.messages == [f"{first.messages[0]} (planned before: {tmp_path / 'plans'})"]


def test_any_changed_input_plans_again(planned, monkeypatch, tmp_path):
    decide_for_training(_config())
    decide_for_training(_config("distributed.devices=1"))  # the config
    assert len(planned) == 2
    monkeypatch.setattr(plan, "host_memory", lambda: 3 * 2**30)  # the memory budget
    decide_for_training(_config())
    assert len(planned) == 3
    links = tmp_path / "links.json"  # the link rates measured on this machine
    monkeypatch.setattr("distrain.planner.timing.MEASURED_FILE", links)
    links.write_text('{"a": 1}')
    decide_for_training(_config())
    links.write_text('{"a": 2}')
    decide_for_training(_config())
    assert len(planned) == 5
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    rates = machine.kept_file(2)  # the rates kept for this machine
    rates.parent.mkdir(parents=True)
    rates.write_text('{"a": 1}')
    decide_for_training(_config())
    decide_for_training(_config())
    assert len(planned) == 6
    module = tmp_path / "mine.py"  # a Module of your own: its source
    module.write_text("x = 1\n")
    decide_for_training(_config(f"training.module={module}:M"))
    module.write_text("x = 22\n")
    decide_for_training(_config(f"training.module={module}:M"))
    assert len(planned) == 8
    monkeypatch.setenv("DISTRAIN_PLAN_CACHE", "off")
    decide_for_training(_config())
    decide_for_training(_config())
    assert len(planned) == 10


GOOD = {
    "strategy": "fsdp",
    "sharding": None,
    "checkpoint": 0,
    "planned_checkpoint": False,
    "accumulate": None,
    "context": 1,
    "experts": 1,
    "sync_each": False,
    "messages": ["kept"],
}


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[1, 2]",
        json.dumps({**GOOD, "extra": 1}).encode(),
        json.dumps({**GOOD, "strategy": "os:system"}).encode(),  # only a registered name, never code
        json.dumps({**GOOD, "checkpoint": "0"}).encode(),
        json.dumps({**GOOD, "planned_checkpoint": 1}).encode(),
        json.dumps({**GOOD, "accumulate": 0}).encode(),
        json.dumps({**GOOD, "checkpoint": -1}).encode(),
        json.dumps({**GOOD, "context": 0}).encode(),
        json.dumps({**GOOD, "context": True}).encode(),
        json.dumps({k: v for k, v in GOOD.items() if k != "context"}).encode(),  # a field missing
        json.dumps({**GOOD, "sharding": "RM_RF"}).encode(),
        json.dumps({**GOOD, "messages": [1]}).encode(),
        json.dumps({**GOOD, "messages": ["x" * cache.MAX_BYTES]}).encode(),  # over the size bound
        "wrong key",
    ],
    ids=[
        "not json",
        "a list",
        "extra field",
        "code",
        "str",
        "bool",
        "accumulate 0",
        "negative",
        "context 0",
        "context bool",
        "missing",
        "sharding",
        "messages",
        "size",
        "key",
    ],
)
def test_a_kept_file_that_is_not_what_distrain_writes_is_ignored_and_planned_over(planned, content):
    key = _key(_config())
    path = cache.directory() / f"{key}.json"
    path.parent.mkdir(parents=True)
    if content == "wrong key":
        content = json.dumps({**GOOD, "key": "0" * 32}).encode()
    elif content.startswith(b"{"):
        content = json.dumps({**json.loads(content), "key": key}).encode()
    path.write_bytes(content)
    decision = decide_for_training(_config())
    assert planned == [2] and decision.strategy == "fsdp" and decision.sharding == "SHARD_GRAD_OP"
    assert cache.read(key)["accumulate"] == 2  # the plan made now replaced it
    os.environ.pop("DISTRAIN_PLANNED", None)


def test_the_first_plan_on_a_machine_is_found_by_the_next_start(monkeypatch, planned, tmp_path):
    """The first plan measures this machine's rates and keeps them, which changes the key: the decision is kept
    under the key the next start computes, not the one this start computed before measuring."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    measuring = decide._planned

    def planned_here(config, job):
        machine.kept_file(2).parent.mkdir(parents=True, exist_ok=True)
        machine.kept_file(2).write_text('{"measured": "now"}')
        return measuring(config, job)

    monkeypatch.setattr(decide, "_planned", planned_here)
    decide_for_training(_config())
    os.environ.pop("DISTRAIN_PLANNED", None)
    assert decide_for_training(_config()).strategy == "fsdp"
    assert planned == [2]


def test_a_kept_file_distrain_wrote_is_read_back_whole(planned):
    key = _key(_config())
    cache.write(key, GOOD)
    assert cache.read(key) == GOOD
    assert decide_for_training(_config()).strategy == "fsdp" and planned == []


def test_every_field_of_a_decision_comes_back_from_the_kept_plan_and_from_the_environment(monkeypatch, tmp_path):
    """A later start and a rank take the whole decision: a field that were not kept would start another layout
    (a context-parallel plan kept without its context size starts tensor parallelism)."""
    import dataclasses

    monkeypatch.setenv("DISTRAIN_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.delenv("DISTRAIN_PLANNED", raising=False)
    chosen = Decision(
        "model_parallel",
        sharding="SHARD_GRAD_OP",
        checkpoint=3,
        planned_checkpoint=True,
        accumulate=4,
        context=2,
        experts=2,
        sync_each=True,
        messages=["distrain: strategy auto → context parallel 2 × fsdp"],
    )
    defaults = Decision("ddp")
    unset = [f.name for f in dataclasses.fields(Decision) if getattr(chosen, f.name) == getattr(defaults, f.name)]
    assert unset == ["stop"], f"give {unset} a value of their own here: this test must see each field come back"
    monkeypatch.setattr(decide, "_planned", lambda config, job: dataclasses.replace(chosen))
    decide_for_training(_config())
    os.environ.pop("DISTRAIN_PLANNED", None)
    monkeypatch.setattr(decide, "_planned", lambda config, job: pytest.fail("planned again"))
    kept = decide_for_training(_config())
    assert dataclasses.replace(kept, messages=chosen.messages) == chosen
    assert kept.messages == [f"{chosen.messages[0]} (planned before: {tmp_path / 'plans'})"]
    assert Decision.from_env(chosen.to_env("f"), "f") == dataclasses.replace(chosen, messages=[])
    assert Decision.from_env(chosen.to_env("f"), "another run") is None
    os.environ.pop("DISTRAIN_PLANNED", None)


# ---- Trainer(strategy="auto"): the run is its module and loader ------------------------------------------------
MODULE_FILE = """
import torch
import distrain


class Regressor(distrain.Module):
    def __init__(self, width):
        super().__init__()
        self.width = width

    def configure_model(self):  # built where the strategy says (the plan builds it on the meta device)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, self.width), torch.nn.ReLU(), torch.nn.Linear(self.width, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)
"""


def test_the_trainer_keeps_its_decision_and_plans_again_for_any_change_of_model_data_or_source(
    monkeypatch, tmp_path, capsys
):
    """A Trainer's second start with the same model and data takes the kept decision (and says so); a wider layer
    built in ``configure_model``, another micro-batch, sample shape or accumulation, and an edit of the module's
    source file are each another key."""
    import importlib.util

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import distrain

    monkeypatch.setenv("DISTRAIN_PLAN_CACHE", str(tmp_path / "plans"))
    plans = []

    def choose(planner, checkpointing):  # the trace and the timing are other tests' business
        plans.append(planner.job.micro_batch)
        return Decision("fsdp", sharding="FULL_SHARD", messages=["distrain: strategy auto → fsdp"])

    monkeypatch.setattr(decide, "choose", choose)
    source = tmp_path / "regressor.py"
    source.write_text(MODULE_FILE)

    def module(width=16):  # imported afresh, as a new start imports it
        spec = importlib.util.spec_from_file_location("regressor", source)
        loaded = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "regressor", loaded)
        spec.loader.exec_module(loaded)
        return loaded.Regressor(width)

    def loader(batch=4, features=8):
        return DataLoader(TensorDataset(torch.randn(32, features), torch.randn(32, 1)), batch)

    def start(model, data, accumulate=1):
        monkeypatch.delenv(decide.PLANNED_ENV, raising=False)
        runtime = distrain.Runtime(strategy="auto", devices=2, accelerator="cpu")
        strategy, _ = decide.for_trainer(runtime, model, data, accumulate, None, {})
        assert type(strategy).__name__ == "FSDPStrategy" and strategy.sharding_strategy == "FULL_SHARD"
        return capsys.readouterr().out

    start(module(), loader())
    assert "planned before" in start(module(), loader()) and len(plans) == 1
    start(module(width=32), loader())  # a layer that configure_model builds wider
    start(module(), loader(batch=8))  # the micro-batch
    start(module(), loader(features=12))  # the sample's shape (the model's first layer would refuse it: no plan)
    start(module(), loader(), accumulate=2)
    assert len(plans) == 5
    source.write_text(MODULE_FILE.replace("mse_loss", "l1_loss"))  # the step's code: no layer or tensor changed
    start(module(), loader())
    assert len(plans) == 6
    assert "planned before" in start(module(), loader()) and len(plans) == 6
    monkeypatch.delenv(decide.PLANNED_ENV, raising=False)
