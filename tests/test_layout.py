"""The layout's rules, read from the source: small modules and functions, one-way doors between rooms.

A room is a top-level module or subpackage of ``dapple_lightning`` (``plan``, ``schedule``,
``runtime``, ``planner``, ``strategy``, ``trials``, ``search``, ...). Rooms import each other without
cycles and only through public names; benchmarks and examples use public names too.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dapple_lightning"
MAX_MODULE_LINES = 900
"""Lightning's larger strategies (fsdp.py) run to about 700 lines in one file: one concept may take
that many; past it a module holds more than one. Below it, cohesion is kept by the rule against
split classes (:func:`test_no_class_declares_attributes_that_other_classes_set`), not by a cap
that invites splitting a class by size."""
LIGHTNING_ADAPTER = "dapple_lightning/strategy/_lightning.py"
"""The one module that imports private Lightning names (and changes Lightning's objects)."""
MAX_FUNCTION_LINES = 80


def _sources(*folders: Path) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(line, imported module, imported names) of every import in ``path``, local ones included."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolve against the importing package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            yield node.lineno, module, [alias.name for alias in node.names]


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "dapple_lightning" and len(parts) > 1 else None


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_module_is_over_the_line_cap() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _sources(PACKAGE)
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_80_lines() -> None:
    long = {}
    for path in _sources(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_room_imports_another_rooms_private_parts() -> None:
    found = []
    for path in _sources(PACKAGE, ROOT / "benchmarks", ROOT / "examples", ROOT / "hydra_plugins"):
        mine = _room(_module_name(path)) if path.is_relative_to(PACKAGE) else None
        for line, module, names in _imports(path):
            theirs = _room(module)
            if theirs is None or theirs == mine:
                continue
            private = [p for p in module.split(".")[1:] if _is_private(p)] + [n for n in names if _is_private(n)]
            if private:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module} {names}")
    assert not found, "imports of another room's private modules or names:\n" + "\n".join(found)


def _room_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _sources(PACKAGE):
        mine = _room(_module_name(path))
        if mine is None:  # the package's front door, which loads the strategy by name only
            continue
        for _, module, _ in _imports(path):
            theirs = _room(module)
            if theirs is not None and theirs != mine:
                graph.setdefault(mine, set()).add(theirs)
    return graph


def test_rooms_import_each_other_without_cycles() -> None:
    graph = _room_graph()
    state: dict[str, str] = {}

    def visit(room: str, path: list[str]) -> None:
        state[room] = "open"
        for dep in sorted(graph.get(room, ())):
            if state.get(dep) == "open":
                pytest.fail(f"import cycle between rooms: {' -> '.join([*path, dep][path.index(dep) :])}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[room] = "done"

    for room in sorted(graph):
        if room not in state:
            visit(room, [room])


LAYERS = [
    ["search"],
    ["trials"],
    ["strategy"],
    ["autoplan"],
    ["surgery"],
    ["runtime"],
    ["planner"],
    ["schedule"],
    ["microbatch", "checkpoint"],
    ["plan", "rows"],
]
"""The rooms from the top down, as the rooms table of docs/architecture.md lists them."""


def test_rooms_import_only_rooms_below_them() -> None:
    level = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    rooms = {_room(_module_name(p)) for p in _sources(PACKAGE)} - {None}
    assert rooms == set(level), f"rooms missing from LAYERS (and docs/architecture.md): {rooms ^ set(level)}"
    upward = [
        f"{room} imports {dep}"
        for room, deps in _room_graph().items()
        for dep in deps
        if level[dep] <= level[room] and dep != room
    ]
    assert not upward, f"imports against the layer order: {upward}"


def test_import_is_light_and_the_strategy_name_registers_with_lightning() -> None:
    code = (
        "import sys, dapple_lightning\n"
        "assert 'lightning' not in sys.modules and 'torch.distributed' not in sys.modules, 'heavy import'\n"
        "import lightning as L\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'dapple' in StrategyRegistry\n"
        "t = L.Trainer(strategy='dapple', accelerator='cpu', devices=1, logger=False, enable_progress_bar=False)\n"
        "print(type(t.strategy).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "DappleStrategy"


def test_importing_lightning_first_registers_too() -> None:
    code = (
        "import lightning\nimport dapple_lightning\n"
        "from lightning.pytorch.strategies import StrategyRegistry\nassert 'dapple' in StrategyRegistry\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr


_RECORDS = ("dataclass", "NamedTuple", "Protocol", "TypedDict")
"""Classes whose body's annotations without a value are their fields."""


def test_no_class_declares_attributes_that_other_classes_set() -> None:
    """A class body's ``name: T`` without a value (outside dataclasses, NamedTuples, Protocols) declares
    an attribute that no code of the class sets: a mixin typing its siblings' attributes, the mark of
    one class split across modules. Such a class belongs in one class, in one module."""
    found = []
    for path in _sources(PACKAGE):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            marks = [ast.unparse(d) for d in node.decorator_list] + [ast.unparse(b) for b in node.bases]
            if any(record in mark for mark in marks for record in _RECORDS):
                continue
            found += [
                f"{path.relative_to(ROOT)}:{item.lineno} {node.name}.{ast.unparse(item.target)}"
                for item in node.body
                if isinstance(item, ast.AnnAssign) and item.value is None
            ]
    assert not found, "attributes declared for another class to set (a split class):\n" + "\n".join(found)


def test_only_the_search_imports_optuna_and_hydra() -> None:
    """The search is Optuna and Hydra; the trials below it, and every other room, are processes and
    training, and import neither (the trial processes never load them)."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources(PACKAGE)
        if _room(_module_name(path)) != "search"
        for line, module, _ in _imports(path)
        if module.split(".")[0] in ("optuna", "hydra")
    ]
    assert not found, "Optuna or Hydra imported outside dapple_lightning/search:\n" + "\n".join(found)


def test_only_the_lightning_adapter_imports_private_lightning_names() -> None:
    found = []
    for path in _sources(PACKAGE):
        if str(path.relative_to(ROOT)) == LIGHTNING_ADAPTER:
            continue
        for line, module, names in _imports(path):
            if module.split(".")[0] not in (
                "lightning",
                "pytorch_lightning",
                "lightning_fabric",
                "lightning_utilities",
            ):
                continue
            private = [p for p in module.split(".") if _is_private(p)] + [n for n in names if _is_private(n)]
            if private:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {private} from {module}")
    assert not found, f"private Lightning names outside {LIGHTNING_ADAPTER}:\n" + "\n".join(found)


def test_code_refers_to_no_tracker_and_never_types_the_strategy_as_any() -> None:
    """A reader of the package cannot open the project's tracker; and rooms below the strategy receive
    explicit parts (``FitParts``), never the strategy typed as ``Any``."""
    import re

    pattern = re.compile(r"\b[Ii]ssue \d|strategy: Any")
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _sources(PACKAGE)
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, "references to a tracker or `strategy: Any`:\n" + "\n".join(found)
