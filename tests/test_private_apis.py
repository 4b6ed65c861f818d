"""No private TensorFlow or Keras API outside the two modules registered for them.

`strategies/tf_patches.py` and `strategies/tf_private.py` hold every private
TF/Keras access, each behind an entry naming its versions and the upstream
behaviour, with a canary test. Elsewhere in `trainer/`, `strategies/` and
`towerflow/`: no import of `tensorflow.python` or `keras.src`, no
`tf.__internal__`, no read of a private name the registry reads (or that
towerflow never defines, so someone else's), and no class overriding a
private member of a TF or Keras class it derives from.
"""

import ast
import importlib
import inspect
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("trainer", "strategies", "towerflow")
# The registry itself: the only modules allowed to reach private TF/Keras names.
REGISTRY = ("strategies/tf_patches.py", "strategies/tf_private.py")
PRIVATE_MODULES = ("tensorflow.python", "keras.src", "tf_keras.src")
# The standard library's own private names in its public API (`os._exit`, namedtuples').
STANDARD = {"_exit", "_getframe", "_asdict", "_replace", "_fields", "_make"}
UPSTREAM = ("tensorflow", "keras", "tf_keras")


def _sources() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[str(path.relative_to(ROOT))] = ast.parse(path.read_text())
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in STANDARD


def _reads(tree: ast.Module, others_only: bool = False):
    """Each `(node, name)` reading a private attribute (of another object than self)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.ctx, ast.Load):
                mine = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                if not (others_only and mine):
                    yield node, node.attr


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines (functions, classes, attributes it sets, names)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
    return {name for name in names if _private(name)}


def _own(tree: ast.Module) -> set[str]:
    """The private names a module gives its own classes (methods, classes, `self._x = ...`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                names.add(node.attr)
    return names


def _outside_registry() -> dict[str, ast.Module]:
    return {path: tree for path, tree in _sources().items() if path not in REGISTRY}


def _where(path: str, node: ast.AST) -> str:
    return f"{path}:{node.lineno}: {ast.unparse(node)}"


def test_no_module_outside_the_registry_imports_tensorflow_or_keras_internals():
    found = []
    for path, tree in _outside_registry().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Attribute):
                modules = [ast.unparse(node)] if node.attr in ("__internal__", "src") else []
            else:
                continue
            for module in modules:
                if module.startswith(PRIVATE_MODULES) or module.endswith(
                    ("tf.__internal__", "tensorflow.__internal__", "keras.src")
                ):
                    found.append(_where(path, node))
    assert not found, "private TF/Keras modules outside the registry:\n" + "\n".join(found)


def test_no_module_outside_the_registry_reads_a_private_name_the_registry_reads():
    registry = _sources()
    upstream_names = {
        name
        for path in REGISTRY
        for _, name in _reads(registry[path], others_only=True)
        if name not in _own(registry[path])
    }
    found = [
        _where(path, node)
        for path, tree in _outside_registry().items()
        for node, name in _reads(tree)
        if name in upstream_names
    ]
    assert not found, "private TF/Keras reads outside the registry:\n" + "\n".join(found)


def test_every_private_name_read_outside_the_registry_is_one_towerflow_defines():
    outside = _outside_registry()
    ours = set().union(*(_defined(tree) for tree in outside.values()))
    found = [
        _where(path, node)
        for path, tree in outside.items()
        for node, name in _reads(tree)
        if name not in ours
    ]
    assert not found, (
        "private names towerflow does not define (TensorFlow's or Keras's? put them behind "
        "an accessor in strategies/tf_private.py):\n" + "\n".join(found)
    )


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] != "__main__" and str(path.relative_to(ROOT)) not in REGISTRY:
                names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _upstream(cls: type) -> bool:
    return cls.__module__.split(".")[0] in UPSTREAM


def test_no_class_outside_the_registry_overrides_a_private_member_of_tensorflow_or_keras():
    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != name:
                continue
            bases = [base for base in cls.__mro__ if _upstream(base)]
            for own in cls.__mro__:
                if _upstream(own) or own.__module__.startswith("strategies.tf_"):
                    continue
                for member in vars(own):
                    if _private(member) and member != "_abc_impl":
                        if any(member in vars(base) for base in bases):
                            found.append(f"{name}.{cls.__name__}: {own.__name__}.{member}")
    assert not found, "private TF/Keras members overridden:\n" + "\n".join(sorted(set(found)))
