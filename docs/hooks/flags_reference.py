"""The command-line flags reference, generated from each command's absl flags at site build.

A mkdocs hook (`mkdocs.yml`, `hooks:`): the page `flags.md` holds the marker
`<!-- flags-reference -->`, which becomes one section per command: the usage from the
module's docstring and a table of its flags (name, default, help), read from
`absl.flags.FLAGS` after importing the module the command runs. Each command is imported
in a process of its own, as each has its own `FLAGS` (two commands may define one name).
Importing defines the flags and runs nothing: the commands start under
`if __name__ == "__main__"`.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

MARKER = "<!-- flags-reference -->"
PAGE = "flags.md"
REPO = pathlib.Path(__file__).resolve().parents[2]
# The command as a user types it -> the module `python -m` runs for it.
COMMANDS = {
    "python -m trainer": "trainer.__main__",
    "python -m trainer.launch": "trainer.launch.__main__",
    "python -m trainer.elastic": "trainer.elastic",
    "python -m trainer.sweep": "trainer.sweep.__main__",
    "python -m trainer.bench": "trainer.bench.__main__",
    "python -m trainer.data_service": "trainer.data_service",
    "python -m trainer.check": "trainer.check",
}
OWN_PACKAGES = ("trainer", "strategies", "towerflow")
IMPORT_TIMEOUT_S = 120

# Run in a fresh interpreter: imports the command's module, prints its flags as JSON.
_READ_FLAGS = """
import importlib, json, sys
from absl import flags
module = importlib.import_module(sys.argv[1])
found = []
for defined_in, defined in flags.FLAGS.flags_by_module_dict().items():
    if defined_in.split(".")[0] in sys.argv[2].split(","):
        for flag in defined:
            found.append({"name": flag.name, "default": repr(flag.default),
                          "help": flag.help, "boolean": bool(flag.boolean),
                          "module": defined_in})
package = importlib.import_module(sys.argv[1].removesuffix(".__main__"))
print(json.dumps({"docs": [module.__doc__ or "", package.__doc__ or ""], "flags": found,
                  "files": [module.__file__, package.__file__]}))
"""


def read_all() -> dict[str, dict]:
    """Command -> {"doc": its module docstring, "flags": [{name, default, help, ...}]}."""
    running = {
        command: subprocess.Popen(
            [sys.executable, "-c", _READ_FLAGS, module, ",".join(OWN_PACKAGES)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command, module in COMMANDS.items()
    }
    found = {}
    for command, process in running.items():
        out, err = process.communicate(timeout=IMPORT_TIMEOUT_S)
        if process.returncode != 0:
            raise RuntimeError(f"importing `{COMMANDS[command]}` for its flags failed:\n{err}")
        found[command] = json.loads(out)
    return found


def usage(doc: str) -> tuple[str, list[str]]:
    """A command docstring's first line, and the indented example lines that follow it."""
    lines = doc.strip().splitlines()
    examples = []
    for line in lines[1:]:
        if line.startswith("    "):
            examples.append(line[4:])
        elif examples:
            break
    return lines[0] if lines else "", examples


def reference(commands: dict[str, dict]) -> str:
    """The markdown of the reference, one section per command."""
    parts = []
    for command, found in commands.items():
        summary, examples = _usage_of(command, found["docs"])
        summary = summary.replace(f"`{command}`: ", "")
        parts += [f"## `{command}`", "", summary[:1].upper() + summary[1:], ""]
        if examples:
            parts += ["```sh", *examples, "```", ""]
        others = {m.removesuffix(".__main__") for m in COMMANDS.values() if m != COMMANDS[command]}
        mine = [f for f in found["flags"] if f["module"] not in others]
        parts += ["| flag | default | meaning |", "| --- | --- | --- |"]
        parts += [_row(flag) for flag in mine]
        parts.append("")
        for other in dict.fromkeys(f["module"] for f in found["flags"] if f not in mine):
            theirs = [f["name"] for f in found["flags"] if f["module"] == other]
            parts += [_borrowed(other, theirs, _read_by_name(found["files"])), ""]
    return "\n".join(parts)


def _read_by_name(files: list[str]) -> set[str]:
    """The flags a command's own source reads as `flags.FLAGS.<name>`."""
    return {
        name
        for path in dict.fromkeys(files)
        for name in re.findall(r"\bFLAGS\.(\w+)", pathlib.Path(path).read_text())
    }


def _borrowed(other: str, names: list[str], read: set[str]) -> str:
    """What a command does with the flags another command's module defines."""
    listed = ", ".join(f"`--{n}`" for n in names)
    used = [n for n in names if n in read]
    if not used:
        return f"It also takes the flags that `{other}` defines: {listed}."
    unused = ", ".join(f"`--{n}`" for n in names if n not in read)
    line = f"Of the flags that `{other}` defines it reads " + ", ".join(f"`--{n}`" for n in used)
    refused = f"; the others ({unused}) it refuses, each in one line (exit 2)."
    return line + (refused if unused else ".")


def flag_names(found: dict) -> set[str]:
    """Every flag a command takes (a boolean `--x` also as `--nox`)."""
    names = set()
    for flag in found["flags"]:
        names.add(flag["name"])
        if flag["boolean"]:
            names.add("no" + flag["name"])
    return names


def _usage_of(command: str, docs: list[str]) -> tuple[str, list[str]]:
    """The usage in the docstring (the module's, else its package's) that describes
    `command` in its first line (`` `python -m x`: ... ``), the one with examples first."""
    usages = [usage(doc) for doc in docs]
    own = [u for u in usages if f"`{command}`:" in u[0] or f"`{command}`):" in u[0]] or usages
    return max(own, key=lambda u: bool(u[1]))


def _row(flag: dict) -> str:
    name = f"--[no]{flag['name']}" if flag["boolean"] else f"--{flag['name']}"
    meaning = " ".join(flag["help"].split()).replace("|", "\\|")
    return f"| `{name}` | `{flag['default']}` | {meaning} |"


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 (mkdocs's)
    """mkdocs hook: fills the flags page's marker with the generated reference."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lacks the marker {MARKER} the reference goes in")
    return markdown.replace(MARKER, reference(read_all()))
