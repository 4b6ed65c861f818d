"""The strategies' glossary, rendered from `strategies/base.py`'s docstring at site build.

A mkdocs hook (`mkdocs.yml`, `hooks:`): a page's marker `<!-- strategy-glossary -->` becomes
the bulleted glossary that opens the docstring of `strategies/base.py` (the list after the
line that starts with "Glossary"), read statically: the build imports nothing of towerflow.
"""

from __future__ import annotations

import ast
import pathlib

MARKER = "<!-- strategy-glossary -->"
BASE = pathlib.Path(__file__).resolve().parents[2] / "strategies" / "base.py"


def glossary(source: str) -> str:
    """The bullets of the docstring's glossary, as markdown."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    lines = doc.splitlines()
    start = next((n for n, line in enumerate(lines) if line.startswith("Glossary")), None)
    if start is None:
        raise ValueError(f"{BASE}'s docstring has no glossary (a line starting `Glossary`)")
    bullets = []
    for line in lines[start + 1 :]:
        if not line.strip():
            if bullets:
                break
            continue
        bullets.append(line)
    return "\n".join(bullets)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs's)
    """mkdocs hook: fills a page's marker with the glossary."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, glossary(BASE.read_text()))
