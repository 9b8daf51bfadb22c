"""This CPU's rates are measured once per machine and kept (``distrain/planner/machine.py``): the same config
gets the same predicted step at every start, however busy the machine is when it starts; a kept file is
untrusted bytes."""

import json
import math

import pytest

from distrain.cli import plan_parser
from distrain.planner import machine, timing
from distrain.planner.cli import TimingArgs

pytestmark = pytest.mark.alone  # it measures this machine's rates (tests/conftest.py)


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(timing, "MEASURED_FILE", tmp_path / "no-links.json")
    return tmp_path


@pytest.fixture
def scripted(monkeypatch, home):
    """Rounds of measurement whose figures the test chooses (one of them disturbed), counted."""
    calls = []
    ops = [2e-6, 9e-6, 2.2e-6, 3e-6, 3.1e-6, 40e-6]

    def measure(ranks_per_node):
        calls.append(ranks_per_node)
        op = ops[(len(calls) - 1) % len(ops)]
        figures = dict(matmul_flops=1e10, memory_bandwidth=5e9, intra_bandwidth=1e9, inter_bandwidth=1e9)
        figures |= dict(collective_seconds=2e-4, blocking_collective_seconds=2e-3, blocking_bandwidth=4e8)
        figures |= dict(element_seconds=2e-9, softmax_element_seconds=1e-8)
        return timing.Hardware(op_seconds=op, **figures, source=timing.cpu_source(ranks_per_node))

    monkeypatch.setattr(machine, "cpu_hardware", measure)
    monkeypatch.setattr(machine, "cpu_matmul_flops", lambda ranks_per_node: 1e10)  # as fast as the rounds say
    monkeypatch.setattr(machine, "_CHECKED", {})  # each test a process of its own
    return calls


def test_the_rates_are_measured_once_with_the_median_of_rounds_and_kept(scripted):
    first = machine.resolve_hardware(False, "32-true", 2)
    assert scripted == [2] * machine.ROUNDS
    assert first.op_seconds == 2.2e-6  # the round disturbed to 9 µs moved nothing
    again = machine.resolve_hardware(False, "32-true", 2)
    assert scripted == [2] * machine.ROUNDS  # nothing measured at the next start
    assert again == first
    assert "kept in" in again.source and "distrain plan --measure" in again.source
    measured = machine.resolve_hardware(False, "32-true", 2, measure=True)  # on request: again, and kept
    assert len(scripted) == 2 * machine.ROUNDS and measured.op_seconds == 3.1e-6
    assert machine.resolve_hardware(False, "32-true", 2) == measured


def test_rates_kept_from_a_busy_machine_are_measured_again_once_it_is_quiet(scripted, monkeypatch, capsys):
    """Kept rates whose matmuls this CPU now beats by ``FASTER`` or more were measured while other work shared the
    cores: measured again and replaced, saying so (checked once per process). A CPU slower now than its kept rate is
    busy now: the kept rates stand, and nothing is measured."""
    first = machine.resolve_hardware(False, "32-true", 2)
    assert len(scripted) == machine.ROUNDS
    monkeypatch.setattr(machine, "cpu_matmul_flops", lambda ranks_per_node: 1e10 / 3)  # busy now
    assert machine.resolve_hardware(False, "32-true", 2) == first and len(scripted) == machine.ROUNDS
    assert "measured while" not in capsys.readouterr().out
    monkeypatch.setattr(machine, "cpu_matmul_flops", lambda ranks_per_node: machine.FASTER * 1e10)  # quiet now
    assert machine.resolve_hardware(False, "32-true", 2) == first  # checked once per process: not again here
    monkeypatch.setattr(machine, "_CHECKED", {})  # a later process
    again = machine.resolve_hardware(False, "32-true", 2)
    assert len(scripted) == 2 * machine.ROUNDS  # measured again, and kept
    said = capsys.readouterr().out
    assert f"distrain: this CPU's matmuls run 1.5× the rate kept in {machine.kept_file(2)}" in said, said
    assert "measured while other work shared its cores; measuring them again" in said
    assert json.loads(machine.kept_file(2).read_text())["rates"]["op_seconds"] == again.op_seconds


def test_each_ranks_per_node_has_its_own_rates(scripted):
    machine.resolve_hardware(False, "32-true", 2)
    machine.resolve_hardware(False, "32-true", 4)  # each rank gets other cores: measured on its own
    assert scripted == [2] * machine.ROUNDS + [4] * machine.ROUNDS
    assert machine.kept_file(2) != machine.kept_file(4)
    assert machine.kept_file(2).is_file() and machine.kept_file(4).is_file()


def test_a_gpu_plan_measures_nothing(scripted):
    hw = machine.resolve_hardware(True, "bf16-mixed", 8, gpu_type="H100")
    assert scripted == [] and hw.overlap


GOOD = {"matmul_flops": 1.0, "memory_bandwidth": 1.0, "op_seconds": 1.0, "intra_bandwidth": 1.0}
GOOD |= {"inter_bandwidth": 1.0, "collective_seconds": 1.0, "blocking_collective_seconds": 1.0}
GOOD |= {"blocking_bandwidth": 1.0, "element_seconds": 1.0, "softmax_element_seconds": 1.0}


@pytest.mark.parametrize(
    "change",
    [
        "not json",
        "a list",
        {"rates": {**GOOD, "op_seconds": float("nan")}},
        {"rates": {**GOOD, "op_seconds": float("inf")}},
        {"rates": {**GOOD, "matmul_flops": -1.0}},
        {"rates": {**GOOD, "matmul_flops": 0.0}},
        {"rates": {**GOOD, "matmul_flops": "1e9"}},
        {"rates": {**GOOD, "matmul_flops": True}},
        {"rates": {**GOOD, "source": 1.0}},  # a field that is not a measured figure
        {"rates": {k: v for k, v in GOOD.items() if k != "op_seconds"}},
        {"rates": [1.0]},
        {"key": "0" * 16},
        {"ranks_per_node": 4},
        {"measured": 3},
        {"extra": 1},
        {"measured": "x" * machine.MAX_BYTES},  # over the size bound
    ],
    ids=lambda c: c if isinstance(c, str) else json.dumps(c, default=str)[:40],
)
def test_a_kept_file_that_is_not_what_distrain_writes_is_measured_over(scripted, change):
    path = machine.kept_file(2)
    path.parent.mkdir(parents=True)
    if change == "not json":
        path.write_bytes(b"\x00\xff not json")
    elif change == "a list":
        path.write_text("[1, 2]")
    else:
        good = {"key": path.stem, "ranks_per_node": 2, "measured": "then", "rates": GOOD}
        path.write_text(json.dumps({**good, **change}))
    hw = machine.resolve_hardware(False, "32-true", 2)
    assert len(scripted) == machine.ROUNDS and hw.op_seconds == 2.2e-6
    kept = json.loads(path.read_text())  # replaced by a measurement
    assert kept["rates"]["op_seconds"] == 2.2e-6
    assert machine.resolve_hardware(False, "32-true", 2) == hw


def test_a_kept_file_distrain_wrote_is_read_back_whole(home):
    path = machine.kept_file(2)
    path.parent.mkdir(parents=True)
    fast = {**GOOD, "matmul_flops": 1e18}  # kept rates this CPU does not beat: they stand
    path.write_text(json.dumps({"key": path.stem, "ranks_per_node": 2, "measured": "then", "rates": fast}))
    hw = machine.resolve_hardware(False, "32-true", 2)
    assert all(getattr(hw, name) == fast[name] for name in GOOD) and "on then" in hw.source


def test_two_starts_of_the_real_measurement_predict_the_same_step(home):
    """The real rates, measured on this machine: the second start takes the first one's figures exactly."""
    first = machine.resolve_hardware(False, "32-true", 2)
    second = machine.resolve_hardware(False, "32-true", 2)
    assert first == second
    assert all(math.isfinite(getattr(first, n)) and getattr(first, n) > 0 for n in machine.MEASURED)


def test_plan_measure_asks_for_a_new_measurement():
    args = plan_parser().parse_args(["--measure"])
    assert TimingArgs.from_args(args).measure is True
    assert TimingArgs.from_args(plan_parser().parse_args([])).measure is False
