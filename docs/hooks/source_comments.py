"""The comments of Python source that document a name: above its line and at its end.

Shared by the generators of docs/hooks/ (mkdocs puts this folder on `sys.path` while it
loads a hook); not a hook itself.
"""

from __future__ import annotations

import io
import tokenize


def comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line number -> (comment text, whether the comment is the whole line)."""
    lines = source.splitlines()
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row, column = token.start
            whole = not lines[row - 1][:column].strip()
            found[row] = (token.string.lstrip("#").strip(), whole)
    return found


def meaning(found: dict[int, tuple[str, bool]], first: int, last: int) -> str:
    """The comment of a statement on lines `first` to `last`: the whole-line comments right
    above it, then the comments at the end of its first and last lines."""
    above = []
    line = first - 1
    while line in found and found[line][1]:
        above.insert(0, found[line][0])
        line -= 1
    inline = [found[n][0] for n in dict.fromkeys((first, last)) if n in found and not found[n][1]]
    return " ".join([*above, *inline]).strip()
