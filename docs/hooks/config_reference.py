"""The configuration reference, generated from `configs/default.py` when the site is built.

A mkdocs hook (`mkdocs.yml`, `hooks:`): the page `configuration.md` holds the marker
`<!-- config-reference -->`, which becomes one table per config section, each field with
its default (from `get_config()`) and its meaning (the comments beside and above it in the
file). Read from the file itself at every build, so the reference cannot drift from the
config; a field without a comment fails the build, naming it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import io
import pathlib
import tokenize

MARKER = "<!-- config-reference -->"
PAGE = "configuration.md"
CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "default.py"


@dataclasses.dataclass
class Entry:
    """One `c.a.b = value` of the config file: a section (a `ConfigDict`) or a field."""

    path: str  # "strategy.mirrored.devices", without the leading `c.`
    is_section: bool
    meaning: str


def entries(source: str) -> list[Entry]:
    """Every assignment to the config in `source`, in order, with its comments.

    A field's meaning is the comment lines right above it and the comment at the end of
    its line; a comment above a run of fields belongs to the first of them.
    """
    comments = _comments(source)
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        path = _config_path(node.targets[0])
        if path is None:
            continue
        above = []
        line = node.lineno - 1
        while line in comments and comments[line][1]:  # whole-line comments, upwards
            above.insert(0, comments[line][0])
            line -= 1
        inline = [
            comments[n][0]
            for n in {node.lineno, node.end_lineno}
            if n in comments and not comments[n][1]
        ]
        is_section = isinstance(node.value, ast.Call) and ast.unparse(node.value.func).endswith(
            "ConfigDict"
        )
        found.append((node.lineno, Entry(path, is_section, " ".join([*above, *inline]).strip())))
    return [entry for _, entry in sorted(found, key=lambda pair: pair[0])]


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text, whether the comment is the whole line)."""
    lines = source.splitlines()
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            whole = not lines[row - 1][:column].strip()
            found[row] = (token.string.lstrip("#").strip(), whole)
    return found


def _config_path(target: ast.expr) -> str | None:
    """`strategy.mirrored.devices` for the target `c.strategy.mirrored.devices`, else None."""
    parts = []
    while isinstance(target, ast.Attribute):
        parts.insert(0, target.attr)
        target = target.value
    if isinstance(target, ast.Name) and target.id == "c" and parts:
        return ".".join(parts)
    return None


def defaults() -> dict:
    """`get_config()` of `configs/default.py`, loaded by path, as nested dicts."""
    spec = importlib.util.spec_from_file_location("towerflow_docs_default_config", CONFIG)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config().to_dict()


def reference(source: str, values: dict) -> str:
    """The markdown of the reference: a table per section, fields in the file's order."""
    rows: dict[str, list[str]] = {"": []}
    intros: dict[str, str] = {"": "Fields at the top of the config."}
    previous = None
    for entry in entries(source):
        section, _, name = entry.path.rpartition(".")
        if entry.is_section:
            rows[entry.path] = []
            intros[entry.path] = entry.meaning
            previous = entry
            continue
        if not entry.meaning and previous is not None and previous.path == section:
            entry.meaning = "See the section's description above."  # the comment above both
        previous = entry
        if not entry.meaning:
            raise ValueError(
                f"`{entry.path}` in {CONFIG} has no comment; document it beside or above "
                "the field (the configuration reference is made from those comments)"
            )
        value = _value(values, entry.path)
        rows[section].append(f"| `{name}` | `{value!r}` | {_cell(entry.meaning)} |")
    parts = []
    for section, lines in rows.items():
        if not lines:
            continue
        title = f"`{section}`" if section else "Top level"
        flag = f"`--config.{section}.FIELD=VALUE`" if section else "`--config.FIELD=VALUE`"
        parts += [f"## {title}", "", intros[section] or "", "", f"Set with {flag}.", ""]
        parts += ["| field | default | meaning |", "| --- | --- | --- |", *lines, ""]
    return "\n".join(parts)


def _value(values: dict, path: str):
    for key in path.split("."):
        values = values[key]
    return tuple(values) if isinstance(values, list) else values


def _cell(text: str) -> str:
    """A comment as a table cell: `|` and `[` taken literally, not as markdown."""
    return text.replace("|", "\\|").replace("[", "\\[")


def on_page_markdown(markdown: str, page, config, files) -> str:
    """mkdocs hook: fills the configuration page's marker with the generated reference."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lacks the marker {MARKER} the reference goes in")
    return markdown.replace(MARKER, reference(CONFIG.read_text(), defaults()))
