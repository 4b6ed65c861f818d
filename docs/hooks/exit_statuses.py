"""The table of exit statuses, generated from `towerflow/errors.py` when the site is built.

A mkdocs hook (`mkdocs.yml`, `hooks:`): a page's marker `<!-- exit-statuses -->`, on the
line after a table's last hand-written row, becomes one row per `*_EXIT_CODE` constant of
`towerflow/errors.py` (the one module of exit statuses): the status and the comment beside
or above it. Read statically, so the site's build imports nothing of towerflow.
"""

from __future__ import annotations

import ast
import pathlib

import source_comments  # docs/hooks/, on `sys.path` while mkdocs loads a hook

MARKER = "<!-- exit-statuses -->"
ERRORS = pathlib.Path(__file__).resolve().parents[2] / "towerflow" / "errors.py"
SUFFIX = "_EXIT_CODE"


def statuses(source: str) -> dict[int, tuple[str, str]]:
    """Status -> (constant name, its comment) for each `NAME_EXIT_CODE = N` in `source`."""
    comments = source_comments.comments(source)
    found = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        name = getattr(node.targets[0], "id", "")
        if not name.endswith(SUFFIX) or not isinstance(node.value, ast.Constant):
            continue
        meaning = source_comments.meaning(comments, node.lineno, node.end_lineno)
        if not meaning:
            raise ValueError(f"`{name}` in {ERRORS} has no comment saying what it means")
        found[node.value.value] = (name, meaning)
    return found


def rows() -> str:
    """The table rows, one per status, in order."""
    found = statuses(ERRORS.read_text())
    return "\n".join(f"| {code} | {meaning} |" for code, (_, meaning) in sorted(found.items()))


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs's)
    """mkdocs hook: fills a page's marker with the rows of the exit statuses."""
    return markdown.replace(MARKER, rows()) if MARKER in markdown else markdown
