"""The package's import graph, read from the source: no cycles (lazy imports inside functions count too, and so do
imports only for type checking: a circle of types is a circle of concepts), and each layer imports only the ones
beneath it at run time."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "distrain"


def _modules() -> dict[str, Path]:
    out = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = file
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (no import at run time)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            lines |= {n.lineno for child in node.body for n in ast.walk(child) if hasattr(n, "lineno")}
    return lines


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """module → the distrain modules it imports anywhere in its source (``from distrain import x`` names
    the module ``distrain.x`` when x is one)."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {name: set() for name in modules}
    for name, file in modules.items():
        tree = ast.parse(file.read_text())
        skip = set() if type_only else _type_checking_only(tree)
        package = name if file.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if node.__class__ not in (ast.Import, ast.ImportFrom) or node.lineno in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else [*subs, base]
            for target in targets:
                found = owner(target) if target.startswith("distrain") else None
                if found and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _reaches(graph: dict[str, set[str]], start: str, prefix: str) -> list[str]:
    return sorted(m for m in graph[start] if m == prefix or m.startswith(prefix + "."))


def test_no_import_cycles():
    graph = import_graph(type_only=True)
    found = cycles(graph)
    detail = [" → ".join(c) + f"  ({'; '.join(f'{m} imports {sorted(graph[m] & set(c))}' for m in c)})" for c in found]
    assert not found, "\n".join(detail)


def test_each_layer_imports_only_the_ones_beneath_it():
    graph = import_graph()
    planner = [m for m in graph if m.startswith("distrain.planner")]
    assert not [
        (m, t) for m in planner for t in graph[m] if t in ("distrain.trainer",) or t.startswith("distrain.training")
    ]
    assert not _reaches(graph, "distrain.runtime", "distrain.planner"), "the runtime never imports the planner"
    assert not _reaches(graph, "distrain.config", "distrain.strategies"), "config.py imports no strategy"
    strategies = [m for m in graph if m.startswith("distrain.strategies")]
    above = (
        "distrain.trainer",
        "distrain.training",
        "distrain.runtime",
        "distrain.cli",
        "distrain.jobs",
        "distrain.planner",
    )
    assert not [(m, t) for m in strategies for t in graph[m] if t.startswith(above)], (
        "strategies know nothing above them"
    )


def test_the_checker_sees_a_cycle():
    """It must be able to fail: a lazy import inside a function closes a cycle just as a top-level one."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_every_package_is_found_by_the_install():
    """pyproject's ``packages.find`` takes only folders with an ``__init__.py``: a folder of modules without
    one imports from a checkout (a namespace package) but is left out of a wheel (``pip install .``)."""
    from setuptools import find_packages

    with_code = {
        ".".join(d.relative_to(PACKAGE.parent).parts)
        for d in [PACKAGE, *PACKAGE.rglob("*")]
        if d.is_dir() and any(d.glob("*.py"))
    }
    assert with_code - set(find_packages(str(PACKAGE.parent), include=["distrain*"])) == set()


# ---- strategies answer for themselves -----------------------------------------------------------------------------
#: what the engines behind the strategies keep on their parameters, optimizers and modules: DeepSpeed's partitions,
#: FSDP2's state, DDP's hook. Code outside ``strategies/`` that reads one is asking a strategy's engine behind its back.
ENGINE_INTERNALS = {
    "ds_id",
    "ds_tensor",
    "ds_shape",
    "_hp_mapping",
    "_get_fsdp_state",
    "_mp_policy",
    "ddp_comm_hook",
    "communication_data_type",
    "fp32_partitioned_groups_flat",
    "single_partition_of_fp32_groups",
}


#: what a user asks for in a strategy's place: a decision (``auto``), every option (``distrain plan``'s ``all``)
REQUESTS = {"auto", "all"}
#: where a strategy answers for itself: its own file, and its cost model in the planner
OWN_FILES = ("strategies", "planner/models")


def _mentions_strategy(node: ast.AST) -> bool:
    """``strategy``, ``self.strategy``, ``trainer.runtime.strategy``, ``registry.start_method_of(…)``…"""
    for sub in ast.walk(node):
        name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else ""
        if "strategy" in name or name == "start_method_of":
            return True
    return False


def strategy_sniffing(source: str) -> list[tuple[int, str]]:
    """Where ``source`` interrogates a strategy instead of asking it: a private attribute read off a strategy; a
    strategy's attribute probed with hasattr/getattr; a strategy (or its start method) compared with a string; an
    engine's internals, read or probed."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            if node.attr in ENGINE_INTERNALS:
                found.append((node.lineno, f"reads the engine's {node.attr}"))
            elif node.attr.startswith("_") and not node.attr.startswith("__") and _mentions_strategy(node.value):
                found.append((node.lineno, f"reads a strategy's private {node.attr}"))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("hasattr", "getattr") and node.args:
            key = node.args[1] if len(node.args) > 1 else None
            name = key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None
            if name in ENGINE_INTERNALS:
                found.append((node.lineno, f"probes the engine's {name}"))
            elif _mentions_strategy(node.args[0]):
                found.append((node.lineno, f"probes a strategy for {name!r}"))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            strings = [s.value for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            strings += [
                e.value
                for s in sides
                if isinstance(s, (ast.Tuple, ast.List, ast.Set))
                for e in s.elts
                if isinstance(e, ast.Constant)
            ]
            if set(strings) - REQUESTS and any(_mentions_strategy(s) for s in sides):
                found.append((node.lineno, "tests a strategy's name"))
    return found


def test_no_module_outside_strategies_interrogates_a_strategy():
    """What verify, the histograms, checkpoints, metrics, jobs and the launcher need comes from methods and traits
    of the strategy: a new strategy then changes nothing outside its own file."""
    found = [
        f"{file.relative_to(PACKAGE.parent)}:{line}: {what}"
        for file in _outside_own_files()
        for line, what in strategy_sniffing(file.read_text())
    ]
    assert not found, "\n".join(sorted(found))


def _outside_own_files() -> list[Path]:
    return [f for f in PACKAGE.rglob("*.py") if not f.relative_to(PACKAGE).as_posix().startswith(OWN_FILES)]


def kind_branching(source: str) -> list[int]:
    """Lines of ``source`` that branch on what kind an option is (``option.family == "fsdp"``, ``o.family in
    ("tp", "pp")``, ``{"fsdp": …}[o.family]``): what the option's cost model answers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            mentions = any(
                isinstance(sub, ast.Attribute) and sub.attr == "family" for s in sides for sub in ast.walk(s)
            )
            strings = any(
                isinstance(sub, ast.Constant) and isinstance(sub.value, str) for s in sides for sub in ast.walk(s)
            )
            if mentions and strings:
                found.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Dict):
            if any(isinstance(sub, ast.Attribute) and sub.attr == "family" for sub in ast.walk(node.slice)):
                found.append(node.lineno)
    return found


def test_only_an_options_own_cost_model_tells_its_kind_apart():
    """The planner prices, names and ranks every option through its cost model (``planner/models/``): a new
    strategy is its file plus its model's, and nothing else in the package changes."""
    found = [
        f"{file.relative_to(PACKAGE.parent)}:{line}"
        for file in _outside_own_files()
        for line in kind_branching(file.read_text())
    ]
    assert not found, "branches on an option's kind outside its cost model:\n" + "\n".join(sorted(found))
    for source in ('o.family == "fsdp"', 'option.family in ("tp", "cp")', '{"ddp": 1}[o.family]'):
        assert kind_branching(source), source  # it can fail on each form
    assert kind_branching("option.model.level(option) == 4") == []


def test_the_sniffing_checker_sees_each_kind():
    """It must be able to fail, on each kind it names."""
    cases = {
        "trainer.strategy._groups": "private",
        "hasattr(p, 'ds_id')": "engine's ds_id",
        "getattr(self.strategy, 'runner', None)": "probes a strategy",
        "trainer.strategy.start_method in (None, 'popen')": "name",
        "registry.start_method_of(strategy) == 'replica_groups'": "name",
        "m._get_fsdp_state()": "engine's _get_fsdp_state",
    }
    for source, kind in cases.items():
        found = strategy_sniffing(source)
        assert found and kind in found[0][1], (source, found)
    assert strategy_sniffing("trainer.strategy.full_parameter(p)") == []
    assert strategy_sniffing("if strategy == 'auto': pass") == []  # a request for the decision, not a strategy
    assert strategy_sniffing("mp.start_processes(f, start_method='fork') if start_method == 'fork' else 0") == []


def private_imports(modules: dict[str, Path] | None = None) -> list[str]:
    """``from distrain.x import _name`` in a module other than ``distrain.x``: one module reaching into another's
    private names (the planner's cost models once read DeepSpeed's ``_fill_buckets`` and ``_hidden_size``)."""
    found = []
    for name, file in (modules or _modules()).items():
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distrain") and not node.level:
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private and node.module != name:
                    found.append(f"{name}:{node.lineno} imports {', '.join(private)} from {node.module}")
    return found


def test_no_module_imports_another_modules_private_names(tmp_path):
    assert not private_imports(), "\n".join(private_imports())
    reaching = tmp_path / "reaching.py"
    reaching.write_text("from distrain.strategies.deepspeed_config import _secret, public\n")
    assert private_imports({"distrain.reaching": reaching}) == [
        "distrain.reaching:1 imports _secret from distrain.strategies.deepspeed_config"
    ]


def private_attributes_reached(package: Path = PACKAGE) -> list[str]:
    """``obj._name`` read or written in a module other than the ones whose classes own ``_name`` (assign
    ``self._name``, define a method or class attribute of that name): one module reaching into another's objects.
    ``compat/`` is left out: reaching into torch's, DeepSpeed's and transformers' private names is its one job."""
    files = {f.relative_to(package).as_posix(): ast.parse(f.read_text()) for f in package.rglob("*.py")}
    owners: dict[str, set[str]] = {}
    for name, tree in files.items():
        for node in ast.walk(tree):
            owned = []
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    owned.append(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owned.append(node.name)
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    targets = item.targets if isinstance(item, ast.Assign) else [getattr(item, "target", None)]
                    owned += [t.id for t in targets if isinstance(t, ast.Name)]
            for attr in owned:
                owners.setdefault(attr, set()).add(name)
    found = []
    for name, tree in files.items():
        if name.startswith("compat/"):
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            value = node.value
            if (isinstance(value, ast.Name) and value.id in ("self", "cls")) or (
                isinstance(value, ast.Call) and getattr(value.func, "id", "") == "super"
            ):
                continue
            if node.attr in owners and name not in owners[node.attr]:
                found.append(f"{name}:{node.lineno} reaches {ast.unparse(node)} (owned by {sorted(owners[node.attr])})")
    return found


def test_no_module_reaches_into_another_modules_objects(tmp_path):
    """Nothing outside a class's module reads or writes its underscore attributes; and the check sees one that does."""
    assert not private_attributes_reached(), "\n".join(private_attributes_reached())
    (tmp_path / "a.py").write_text("class Stage:\n    def __init__(self):\n        self._said = False\n")
    (tmp_path / "b.py").write_text("def warn(stage):\n    stage._said = True\n")
    assert private_attributes_reached(tmp_path) == ["b.py:2 reaches stage._said (owned by ['a.py'])"]


# ---- the Trainer's private members stay the Trainer's ----------------------------------------------------------------
#: the private members of the Trainer that other modules reach: none. Its stages and loop parts are handed what they
#: call back (as ``Evaluator`` is); the conventions ``distrain.lightning``'s Trainer overrides are public methods
TRAINER_PRIVATE_REACHED: set[tuple[str, str]] = set()


def trainer_private_reached(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """(file, member) for each ``trainer._member`` (or ``self.trainer._member``) read outside the Trainer's files."""
    own = {"trainer.py", "lightning/trainer.py"}
    reached = set()
    for file in package.rglob("*.py"):
        name = file.relative_to(package).as_posix()
        if name in own:
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if owner_name == "trainer":
                    reached.add((name, node.attr))
    return reached


def test_no_module_reaches_further_into_the_trainer(tmp_path):
    """No module outside the Trainer's files reads its private members; and the check sees one that does."""
    assert trainer_private_reached() <= TRAINER_PRIVATE_REACHED, trainer_private_reached() - TRAINER_PRIVATE_REACHED
    (tmp_path / "callbacks").mkdir()
    (tmp_path / "callbacks" / "peek.py").write_text("def on_end(trainer):\n    return trainer._progress_secret\n")
    assert trainer_private_reached(tmp_path) == {("callbacks/peek.py", "_progress_secret")}


def test_the_trainer_class_reads_in_under_550_lines():
    """The loop stays readable top to bottom in ``trainer.py``; what it is made of lives in ``training/`` (its epoch
    data, its step's parts, its options), each given the narrow pieces it needs."""
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 < 550, trainer.end_lineno - trainer.lineno + 1
