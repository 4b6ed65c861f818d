"""The layers' imports: no cycle among towerflow's modules, and `strategies/` never imports up.

Read from the source (no module is imported), so the whole tree is checked
in well under a second. Every import counts, those inside functions too (a
late import hides a cycle, it does not break the dependency); only an
`if TYPE_CHECKING:` block, which never runs, is left out.
"""

import ast
import pathlib

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


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


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
    graph["trainer.loop.lock"] = graph["trainer.loop.lock"] | {
        "trainer.cli"
    }  # as `cli.one_line` was
    cycle = _cycle(graph)
    assert cycle[0] == cycle[-1] and {"trainer.cli", "trainer.loop.lock"} <= set(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_back():
    assert _cycle(_graph()) == []


def test_strategies_never_import_the_trainer():
    upward = {
        name: sorted(t for t in targets if t.startswith("trainer"))
        for name, targets in _graph().items()
        if name.startswith("strategies")
    }
    assert {name: up for name, up in upward.items() if up} == {}


def test_the_errors_module_imports_nothing_of_towerflow():
    assert _graph()["towerflow.errors"] == set()
