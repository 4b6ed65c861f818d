"""The configuration reference, generated from every config module when the site is built.

A mkdocs hook (`mkdocs.yml`, `hooks:`): the page `configuration.md` holds the marker
`<!-- config-reference -->`, which becomes one table per config section. The fields and
their defaults are what each `configs/*.py`'s `get_config()` returns (loaded, not parsed,
so it does not matter how a config file builds them); a field only some configs have says
which. Each field's meaning is its comment, found in either of two places:

* beside or above its assignment in a config file (`c.train.steps = 1000  # ...`);
* beside or above its field in a declaration: a dataclass whose docstring opens with its
  section in backticks (`class MirroredOptions: \"\"\"`strategy.mirrored`.\"\"\"`), as the
  strategy plugins' options (strategies/options.py) and the loop's components' sections
  (trainer/loop/options.py, `towerflow.sections`) are declared. "`export`." declares a
  section of its own, and the rest of the docstring is the section's description;
  "`train`: ..." declares some fields of a section. A declaration documents its fields
  before a config file does, and gives their type.

A field with no comment in either fails the build, naming it. Sections come in the order
configs/default.py makes them, each under its parent. After the sections, a table per
config other than the default lists the defaults it changes.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pathlib
import re

import ml_collections
import source_comments  # docs/hooks/, on `sys.path` while mkdocs loads a hook

MARKER = "<!-- config-reference -->"
PAGE = "configuration.md"
REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
DEFAULT = CONFIGS / "default.py"
# Where options dataclasses live (their docstring names the config section they hold).
DATACLASS_ROOTS = ("strategies", "trainer", "towerflow")
# "`export`." (a section of its own) or "`train`: ..." (some fields of one).
_SECTION_DOC = re.compile(r"\s*`([a-z_][\w.]*)`(\.?)")


@dataclasses.dataclass
class Entry:
    """One documented name: a section (a `ConfigDict`) or a field, and its comment."""

    path: str  # "strategy.mirrored.devices", without the leading `c.`
    is_section: bool
    meaning: str
    kind: str = ""  # its declared type ("int", "tuple[int, ...]"); "" where none is declared


def config_modules() -> list[pathlib.Path]:
    """Every config module in configs/, the default first."""
    others = sorted(p for p in CONFIGS.glob("*.py") if p.name not in ("__init__.py", DEFAULT.name))
    return [DEFAULT, *others]


def load(path: pathlib.Path) -> ml_collections.ConfigDict:
    """`get_config()` of the config file at `path`, loaded by path (not as `configs.x`)."""
    spec = importlib.util.spec_from_file_location(f"towerflow_docs_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def defaults(path: pathlib.Path = DEFAULT) -> dict:
    """The config of `path` as nested dicts (placeholders and references resolved)."""
    return load(path).to_dict()


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """Dotted path -> value of every field (not section) of a nested dict."""
    found = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            found.update(leaves(value, f"{prefix}{key}."))
        else:
            found[prefix + key] = tuple(value) if isinstance(value, list) else value
    return found


def sections(tree: dict, prefix: str = "") -> list[str]:
    """Every section's dotted path, the top level as ""."""
    found = [prefix.rstrip(".")]
    for key, value in tree.items():
        if isinstance(value, dict):
            found += sections(value, f"{prefix}{key}.")
    return found


# ---------------------------------------------------------------- comments of config files


def entries(source: str) -> list[Entry]:
    """Every assignment to the config (`c.a.b = ...`) in `source`, in order, with its comment.

    A field's meaning is the comment lines right above it and the comment at the end of
    its line. A comment above a run of fields (one per line, no blank line between) is
    every one's of them that has no comment of its own.
    """
    found_comments = source_comments.comments(source)
    found: list[tuple[int, int, Entry]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        path = _config_path(node.targets[0])
        if path is None:
            continue
        is_section = isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith(
            "ConfigDict"
        )
        text = source_comments.meaning(found_comments, node.lineno, node.end_lineno)
        found.append((node.lineno, node.end_lineno, Entry(path, is_section, text)))
    found.sort(key=lambda item: item[0])
    for (_, end, lead), (start, _, entry) in zip(found, found[1:]):
        if entry.meaning or start != end + 1:
            continue
        if not lead.is_section:
            entry.meaning = lead.meaning  # one comment above a run of fields
        elif entry.path.rpartition(".")[0] == lead.path:
            entry.meaning = "See the section's description above."  # the comment above both
    return [entry for _, _, entry in found]


def _config_path(target: ast.expr) -> str | None:
    """`strategy.mirrored.devices` for the target `c.strategy.mirrored.devices`, else None."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.insert(0, target.attr)
        target = target.value
    if isinstance(target, ast.Name) and target.id in ("c", "config") and parts:
        return ".".join(parts)
    return None


# ------------------------------------------------------------ comments of options dataclasses


def dataclass_entries(source: str) -> list[Entry]:
    """The fields of every dataclass in `source` whose docstring names its config section.

    `class MirroredOptions:` with the docstring "`strategy.mirrored`." gives the section
    `strategy.mirrored` (the rest of its docstring, if any, as its description) and one
    entry per annotated field, with the comments beside and above it and its type. A
    docstring "`train`: ..." gives the fields only: the section is described elsewhere.
    """
    found_comments = source_comments.comments(source)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef) or not _is_dataclass(node):
            continue
        match = _SECTION_DOC.match(ast.get_docstring(node) or "")
        if not match:
            continue
        section = match.group(1)
        if match.group(2):  # a section of its own: the docstring's other lines describe it
            intro = ast.get_docstring(node).partition("\n")[2]
            found.append(Entry(section, True, " ".join(intro.split())))
        for field in node.body:
            if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name):
                if "ClassVar" in ast.unparse(field.annotation):
                    continue  # not a field
                text = source_comments.meaning(found_comments, field.lineno, field.end_lineno)
                kind = ast.unparse(field.annotation)
                found.append(Entry(f"{section}.{field.target.id}", False, text, kind))
    return found


def _is_dataclass(node: ast.ClassDef) -> bool:
    for decorator in node.decorator_list:
        name = ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator)
        if name.split(".")[-1] == "dataclass":
            return True
    return False


def documented() -> dict[str, Entry]:
    """Path -> the entry that documents it: its declaration's (a dataclass's) first, then
    the default config's comment, then another config's.

    The order is the default config's (where it builds a declared section, the section
    is there), then the declarations', then the other configs'.
    """
    found: dict[str, Entry] = {}

    def add(new: list[Entry], wins: bool = False) -> None:
        for entry in new:
            if entry.path not in found or not found[entry.path].meaning or wins and entry.meaning:
                found[entry.path] = entry  # a key replaced keeps its place

    add(entries(DEFAULT.read_text()))
    for root in DATACLASS_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            text = path.read_text()
            if "dataclass" in text:
                add(dataclass_entries(text), wins=True)
    for path in config_modules()[1:]:
        add(entries(path.read_text()))
    return found


# ---------------------------------------------------------------------------- the page


def reference(configs: dict[str, dict], notes: dict[str, Entry]) -> str:
    """The markdown of the reference.

    Args:
      configs: config file name ("default.py", "ctr.py") -> its config as nested dicts,
        the default first.
      notes: path -> its entry (`documented()`).
    """
    (default_name, default), *others = configs.items()
    values = {name: leaves(tree) for name, tree in configs.items()}
    order = {path: n for n, path in enumerate(notes)}
    every_leaf = {path for tree in values.values() for path in tree}
    undocumented = sorted(p for p in every_leaf if not (notes.get(p) and notes[p].meaning))
    if undocumented:
        raise ValueError(
            f"`{undocumented[0]}` has no comment; document it beside or above the field in "
            f"configs/ or in the options dataclass of its section (the configuration "
            f"reference is made from those comments); undocumented: {', '.join(undocumented)}"
        )
    every_section = dict.fromkeys(s for tree in configs.values() for s in sections(tree))
    parts = []

    def place(path: str) -> tuple:
        # Under its parent, among its siblings in the order they were documented.
        names = path.split(".")
        steps = (".".join(names[: n + 1]) for n in range(len(names)))
        return tuple((order.get(step, len(order)), step) for step in steps)

    for section in sorted(every_section, key=lambda s: place(s) if s else ()):
        fields = sorted((p for p in every_leaf if p.rpartition(".")[0] == section), key=place)
        if not fields:
            continue
        rows = [_row(path, notes[path], values, default_name) for path in fields]
        title = f"`{section}`" if section else "Top level"
        flag = f"`--config.{section}.FIELD=VALUE`" if section else "`--config.FIELD=VALUE`"
        parts += [f"## {title}", "", _intro(section, notes), "", f"Set with {flag}.", ""]
        parts += ["| field | type | default | meaning |", "| --- | --- | --- | --- |", *rows, ""]
    for name, _ in others:
        parts += _changes(name, values[default_name], values[name], notes)
    return "\n".join(parts)


def _intro(section: str, notes: dict[str, Entry]) -> str:
    """A section's description: its declaration's docstring or the comment above it."""
    if not section:
        return "Fields at the top of the config."
    if section in notes and notes[section].meaning:
        return notes[section].meaning
    parent, _, name = section.rpartition(".")
    if parent == "strategy":
        return f"The options of the `{name}` strategy plugin, read under `--strategy={name}`."
    return ""


def _row(path: str, entry: Entry, values: dict[str, dict], default_name: str) -> str:
    name = path.rpartition(".")[2]
    if path in values[default_name]:
        value = values[default_name][path]
        default = f"`{value!r}`"
    else:
        value = next(values[config][path] for config in values if path in values[config])
        default = "; ".join(
            f"`{values[config][path]!r}` (configs/{config} only)"
            for config in values
            if path in values[config]
        )
    kind = (entry.kind or _kind(value)).replace(" | ", " or ")
    kind = f"`{kind}`" if kind else ""
    return f"| `{name}` | {kind} | {default} | {_cell(entry.meaning)} |"


def _kind(value: object) -> str:
    """The type of an undeclared field, from its default ("" for a placeholder's None)."""
    if isinstance(value, (tuple, list)):
        return "tuple"
    return "" if value is None else type(value).__name__


def _changes(name: str, default: dict, config: dict, notes: dict[str, Entry]) -> list[str]:
    """The section of a config other than the default: the defaults it changes."""
    changed = [p for p in config if p in default and config[p] != default[p]]
    rows = [f"| `{p}` | `{default[p]!r}` | `{config[p]!r}` |" for p in changed]
    added = [p for p in config if p not in default]
    lines = [f"## `configs/{name}`", "", _summary(CONFIGS / name), ""]
    lines += [f"`--config=configs/{name}` starts from the default and changes {len(rows)} of its "]
    lines[-1] += f"values; it adds {len(added)} fields (in the sections above)."
    lines += ["", "| field | configs/default.py | " + f"configs/{name} |", "| --- | --- | --- |"]
    return [*lines, *rows, ""]


def _summary(path: pathlib.Path) -> str:
    """The first line of a config module's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def _cell(text: str) -> str:
    """A comment as a table cell: `|` and `[` taken literally, not as markdown."""
    return text.replace("|", "\\|").replace("[", "\\[")


def generated() -> str:
    """The generated reference for this checkout."""
    configs = {path.name: load(path).to_dict() for path in config_modules()}
    return reference(configs, documented())


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs's)
    """mkdocs hook: fills the configuration page's marker with the generated reference."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lacks the marker {MARKER} the reference goes in")
    return markdown.replace(MARKER, generated())
