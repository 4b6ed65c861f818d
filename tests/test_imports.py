"""The layers' imports: no cycle among towerflow's modules, and no layer imports one above it.

The layers, bottom to top (BUILD.md, "Architecture"): the shared core
`towerflow/`; the distribution, `strategies/`; the model's layers and the
input, `trainer/layers/` and `trainer/data/`; the loop, `trainer/loop/`; the
commands at the top of `trainer/`. Read from the source (no module is
imported), so the whole tree is checked in well under a second. Every
import counts, those inside functions too (a late import hides a cycle, it
does not break the dependency); only an `if TYPE_CHECKING:` block, which
never runs, is left out.
"""

import ast
import functools
import pathlib
import re

import pytest

from tests.helpers import assert_exit

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("towerflow", "strategies", "trainer", "configs")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _import_statements(tree: ast.Module):
    """Every import statement of a module that can run."""
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        yield from (n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The towerflow modules `name` imports when it loads."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _import_statements(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        # A module's own packages load before it, whatever it imports: not a cycle.
        found |= {t for t in targets if t in modules and not f"{name}.".startswith(f"{t}.")}
    return found


@functools.cache
def _read_graph() -> tuple[tuple[str, frozenset[str]], ...]:
    modules = _modules()
    return tuple((name, frozenset(_imports(name, path, modules))) for name, path in modules.items())


def _graph() -> dict[str, set[str]]:
    """Each module's imports of towerflow modules (a fresh copy: a test may change it)."""
    return {name: set(targets) for name, targets in _read_graph()}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (a path from a module back to itself), or []."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = "open"
        path.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == "open":
                return path[path.index(other) :] + [other]
            if other not in state and (found := visit(other)):
                return found
        path.pop()
        state[node] = "done"
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_reader_finds_the_imports_it_should():
    graph = _graph()
    assert "trainer.cli" in graph["trainer.__main__"]
    assert {"towerflow.errors", "towerflow.storage"} <= graph["trainer.loop.lock"]
    assert "strategies.cluster.membership" in graph["strategies.multi_worker"]


def test_the_old_cycle_through_the_command_line_would_be_found():
    graph = _graph()
    graph["trainer.loop.lock"] = graph["trainer.loop.lock"] | {"trainer.cli"}  # as `one_line` was
    cycle = _cycle(graph)
    assert cycle[0] == cycle[-1] and {"trainer.cli", "trainer.loop.lock"} <= set(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    assert _cycle(_graph()) == []


# Bottom to top; a module belongs to the layer of its longest prefix here.
LAYERS = (
    # the shared core (errors, Registry, files, processes); configs, and the declarations
    # they are built from (TensorFlow-free: the plugins' options, the loop's components')
    ("towerflow", "configs", "strategies.options", "trainer.loop.options"),
    ("strategies",),  # distribution: the plugins, their interface, the cluster
    ("trainer.layers", "trainer.data"),  # the model's layers and the input
    ("trainer.loop",),  # the loop: the job, controller, actions, step, checkpoints
    ("trainer",),  # the commands: __main__, cli, launch, sweep, bench, data_service, check
)
COMMANDS = {"__init__", "__main__", "cli", "elastic", "data_service", "check"}
FOLDERS = {"assets", "bench", "data", "launch", "layers", "loop", "retrieval", "sweep"}


def _layer(name: str) -> int:
    found = [
        (len(prefix), i)
        for i, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if name == prefix or name.startswith(f"{prefix}.")
    ]
    return max(found)[1]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a layer above its own."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if _layer(target) > _layer(name)
    )


def test_no_layer_imports_one_above_it():
    assert _upward(_graph()) == []


def test_an_import_from_a_layer_above_would_be_found():
    graph = _graph()
    graph["trainer.data.base"] = graph["trainer.data.base"] | {"trainer.loop.calls"}
    graph["towerflow.storage"] = graph["towerflow.storage"] | {"strategies"}
    assert _upward(graph) == [
        "towerflow.storage -> strategies",
        "trainer.data.base -> trainer.loop.calls",
    ]


def test_the_layers_and_the_input_do_not_import_each_other():
    def part(name: str) -> str:
        return ".".join(name.split(".")[:2])

    across = [
        f"{name} -> {target}"
        for name, targets in _graph().items()
        for target in targets
        if {part(name), part(target)} == {"trainer.layers", "trainer.data"}
    ]
    assert across == []


def test_configs_import_of_towerflow_only_the_declarations():
    # A config file loads before any TensorFlow; the options dataclasses are its imports.
    imported = {name: t for name, t in _graph().items() if name.startswith("configs") and t}
    found = {t for targets in imported.values() for t in targets}
    assert found == {"strategies.options", "trainer.loop.options"}


def test_the_declarations_load_without_tensorflow():
    import subprocess
    import sys

    loaded = "import sys, strategies.options, trainer.loop.options, configs.default; "
    loaded += "print({'tensorflow', 'keras'} & set(sys.modules))"
    found = subprocess.run([sys.executable, "-c", loaded], cwd=ROOT, capture_output=True, text=True)
    assert found.stdout.strip() == "set()", found.stderr


def test_the_top_of_trainer_holds_the_commands_and_the_layers_folders():
    top = ROOT / "trainer"
    assert {p.stem for p in top.glob("*.py")} == COMMANDS
    assert {p.name for p in top.iterdir() if p.is_dir() and p.name != "__pycache__"} == FOLDERS


def test_every_package_is_in_the_wheel():
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib before Python 3.11
    listed = re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.M | re.S)[1])
    packages = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert packages <= set(listed), "add them to pyproject.toml's `packages`"


def _imported_when_it_loads(path: pathlib.Path) -> set[str]:
    """The modules a file imports at its top level (not inside a function)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module)
    return found


def test_the_shared_core_does_not_import_tensorflow_when_it_loads():
    heavy = {
        f"{name}: {module}"
        for name, path in _modules().items()
        if name.startswith("towerflow")
        for module in _imported_when_it_loads(path)
        if module.split(".")[0] in ("tensorflow", "keras")
    }
    assert heavy == set()
    assert "tensorflow" in _imported_when_it_loads(ROOT / "trainer" / "loop" / "train.py")


def test_the_errors_module_imports_nothing_of_towerflow():
    assert _graph()["towerflow.errors"] == set()


def test_the_public_names_are_at_the_top_of_trainer():
    import trainer
    from trainer.loop import actions, tasks, train

    assert (trainer.Task, trainer.Action, trainer.StopTraining) == (
        tasks.Task,
        actions.Action,
        actions.StopTraining,
    )
    assert trainer.train_and_evaluate is train.train_and_evaluate
    with pytest.raises(AttributeError, match="no attribute 'Tsak'"):
        trainer.Tsak  # noqa: B018


def test_the_cluster_commands_define_their_flags_beside_each_other():
    # A test process imports several commands; absl refuses a flag two modules define.
    import subprocess
    import sys

    commands = [
        "trainer.launch",
        "trainer.elastic",
        "trainer.data_service",
        "trainer.sweep.__main__",
    ]
    code = f"import importlib\nfor m in {commands!r}: importlib.import_module(m)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert_exit(result)


LONGEST_FUNCTION = 70  # lines; a function longer than this reads as several steps: split it


def test_every_function_outside_configs_reads_in_under_70_lines():
    long = []
    for module, path in _modules().items():
        if module.startswith("configs"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= LONGEST_FUNCTION:
                    long.append(f"{module}.{node.name}: {lines} lines")
    assert not long, long
