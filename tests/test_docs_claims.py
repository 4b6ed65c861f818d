"""What the docs pages claim of the code is true: config fields, defaults, exit statuses, flags.

The pages are read as a user reads them. Every config field a page names in backticks
(`train.steps`, `--config.model.capacity=...`) exists in a config of `configs/`; a table
with a "default" column states each field's default as `get_config()` returns it; a sample
output of a command prints the config values that command runs with; every exit status a
page names is defined in `towerflow/errors.py` (or is 0 or 1), and the troubleshooting table
lists each; every `--flag` of a command line exists for its command, and every `--flag` a
page names exists for some command. The ground truth comes from the site's own generators
(`docs/hooks/`), so the references and these checks read the code the same way.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import re
import shlex

from tests.helpers import REPO
from tests.test_docs import _load_hook

DOCS = pathlib.Path(REPO, "docs")
EXAMPLES = pathlib.Path(REPO, "examples")
PAGES = sorted(DOCS.glob("*.md"))
# Dotted names that start like a config section but are Keras or TensorFlow attributes, and
# the pages' placeholders (`--config.a.b=value`, a plugin's `strategy.my_strategy`).
NOT_CONFIG = {"model.fit", "model.compile", "model.losses", "model.evaluate", "model.predict"}
NOT_CONFIG |= {"strategy.run", "a.b", "x", "strategy.my_strategy"}
# The section of docs/components.md's example component (a user's, in no config of configs/).
NOT_CONFIG |= {"examples_seen.enabled", "examples_seen.metric", "examples_seen.enabeld"}
# Exit statuses every command has without a constant: success, and a Python traceback.
CONVENTIONAL_STATUSES = {0, 1}
ABSL_FLAGS = {"help", "helpfull", "helpshort", "flagfile", "undefok", "verbosity", "v"}
ABSL_FLAGS |= {"logtostderr", "alsologtostderr", "log_dir", "stderrthreshold", "only_check_args"}
# Other tools' flags the pages name: Slurm's `srun`, TensorBoard's, TF Serving's, `timeout`'s.
FOREIGN_FLAGS = {"ntasks", "kill", "logdir", "model_base_path", "seconds"}
# Commands that pass the flags after `--` to `python -m trainer`.
PASS_THROUGH = {"launch", "elastic", "sweep", "check"}
TRAINER = "python -m trainer"


_hook = _load_hook  # a generator of docs/hooks/, loaded by path as mkdocs loads it


@functools.cache
def configs() -> dict[str, dict]:
    """Config file name -> its config as nested dicts, the default first, then the examples'.

    An example's own fields (`task.*` of examples/retrieval.py) are as real to
    the page that shows its command as configs/'s.
    """
    hook = _hook("config_reference")
    found = {path.name: hook.defaults(path) for path in hook.config_modules()}
    for path in sorted(EXAMPLES.glob("*.py")):
        if "def get_config" in path.read_text():
            found[f"examples/{path.name}"] = hook.defaults(path)
    return found


@functools.cache
def config_paths(examples: bool = True) -> set[str]:
    """Every field's and section's dotted path in any config (of configs/ alone: not examples)."""
    hook = _hook("config_reference")
    found = set()
    for name, tree in configs().items():
        if examples or not name.startswith("examples/"):
            found |= set(hook.leaves(tree)) | set(hook.sections(tree))
    return found - {""}


@functools.cache
def command_flags() -> dict[str, set[str]]:
    """`python -m trainer.x` (and `towerflow`) -> the flags it takes."""
    hook = _hook("flags_reference")
    found = {command: hook.flag_names(read) for command, read in hook.read_all().items()}
    found["towerflow"] = found[TRAINER]
    return found


def _sections() -> set[str]:
    return {path.split(".")[0] for path in config_paths()}


def _config_names(text: str) -> list[str]:
    """The config paths a text names in backticks: `a.b.c`, `a.b=v`, `--config.a.b=v`."""
    names = []
    for code in re.findall(r"`([^`\n]+)`", text):
        code = code.removeprefix("--config.")
        match = re.fullmatch(r"([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(=.*)?", code)
        if match and match.group(1).split(".")[0] in _sections():
            names.append(match.group(1))
    for code in re.findall(r"--config\.([a-z0-9_.]+)=", text):
        names.append(code)
    return [name for name in names if name not in NOT_CONFIG]


def test_every_config_field_a_page_names_exists():
    unknown = [
        f"{page.name}: `{name}`"
        for page in PAGES
        for name in _config_names(page.read_text())
        if name not in config_paths()
    ]
    assert not unknown, "config fields named in the docs that no config has:\n" + "\n".join(
        sorted(set(unknown))
    )


def test_the_configuration_reference_documents_every_field_the_pages_name():
    """Every field a page tells users to set is in the generated reference (with its meaning)."""
    hook = _hook("config_reference")
    documented = {path for path, entry in hook.documented().items() if entry.meaning}
    named = {name for page in PAGES for name in _config_names(page.read_text())}
    assert not sorted(named & config_paths(examples=False) - documented)


def _value(cell: str):
    """A table cell's value: a number, a tuple, or a string (its backticks taken off)."""
    text = cell.strip().strip("`").strip()
    if re.fullmatch(r"[\d_*+\-.e() ,<]+", text):
        try:
            return eval(text, {"__builtins__": {}})  # digits and operators only, as matched
        except SyntaxError:
            return text
    return text.strip("'\"")


def _same(stated, actual) -> bool:
    if isinstance(actual, bool) or isinstance(stated, str):
        return str(stated).lower() == str(actual).lower()
    if isinstance(actual, (int, float)) and isinstance(stated, (int, float)):
        return abs(stated - actual) <= 1e-9 * max(1, abs(actual))
    return stated == actual


def _default_rows(text: str):
    """(names, defaults) of each row of a markdown table with a "default" column."""
    header = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if "|" in line else None
        if cells is None:
            header = None
        elif header is None:
            header = cells
        elif "default" in header and not set(line) <= set("|- "):
            yield cells[0], cells[header.index("default")]


def test_every_default_a_table_states_is_the_configs():
    wrong = []
    for page in PAGES:
        for first, stated in _default_rows(page.read_text()):
            names = [n for n in _config_names(first) if n in config_paths()]
            values = [v for v in re.split(r",\s*", stated) if v] if len(names) > 1 else [stated]
            for name, value in zip(names, values):
                actual = _effective({}, name)
                if not _same(_value(value), actual):
                    wrong.append(f"{page.name}: `{name}` stated {value}, is {actual!r}")
    assert not wrong, "\n".join(wrong)


def _by_leaf_name(name: str) -> str | None:
    """The config path `name` means: itself, or the one path ending in `.name`."""
    if name in config_paths():
        return name
    matches = [p for p in config_paths() if p.endswith("." + name)]
    return matches[0] if len(matches) == 1 else None


def _prose_defaults(text: str):
    """(name, stated default) of what prose says: "`a.b=V`, the default", "`a.b` ...
    default `V`"."""
    for name, value in re.findall(r"`([a-z_][\w.]*)=([^`]*)`,? \(?the default", text):
        yield name, value
    for name, _, value in re.findall(r"`([a-z_][\w.]*)`([^`]{0,120}?)\bdefault `([^`]*)`", text):
        yield name, value


def test_every_default_the_prose_states_is_the_configs():
    wrong = []
    for page in PAGES:
        for name, stated in _prose_defaults(page.read_text()):
            path = _by_leaf_name(name)
            if path is None:
                continue
            actual = _effective({}, path)
            if not _same(_value(stated), actual):
                wrong.append(f"{page.name}: `{path}` default stated {stated}, is {actual!r}")
    assert not wrong, "\n".join(wrong)


def _effective(config_file: str | dict, name: str):
    """The value of `name` in a config file's config (the default's) with overrides."""
    overrides = config_file if isinstance(config_file, dict) else {}
    if name in overrides:
        return overrides[name]
    tree = configs().get(config_file if isinstance(config_file, str) else "", None)
    tree = tree or next(t for t in configs().values() if _has(t, name))
    for key in name.split("."):
        tree = tree[key]
    return tuple(tree) if isinstance(tree, list) else tree


def _has(tree: dict, name: str) -> bool:
    for key in name.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return False
        tree = tree[key]
    return True


def _samples(text: str):
    """(command, output lines) of each ```text block that starts with a command."""
    for block in re.findall(r"```text\n(.*?)```", text, re.S):
        lines = block.replace("\\\n", " ").splitlines()
        if lines and re.match(r"(\$ )?(python -m trainer(\.\w+)*|towerflow)(\s|$)", lines[0]):
            yield lines[0].removeprefix("$ "), lines[1:]


def test_a_sample_output_prints_the_config_its_command_runs_with():
    """`... (eviction lfu), min_count 1, ...` as the command's config has them."""
    wrong = []
    for page in PAGES:
        for command, output in _samples(page.read_text()):
            args = shlex.split(command)
            config = next((a.split("/")[-1] for a in args if a.startswith("--config=")), None)
            config = config or "default.py"
            if config not in configs():
                continue
            overrides = dict(
                a.removeprefix("--config.").split("=", 1) for a in args if a.startswith("--config.")
            )
            leaves = _hook("config_reference").leaves(configs()[config])
            names = {}
            for path in leaves:
                names.setdefault(path.rsplit(".", 1)[-1], []).append(path)
            for line in output:
                for key, printed in re.findall(r"\(?\b([a-z]+_[a-z_]+|eviction) ([\w.']+)", line):
                    if len(names.get(key, ())) != 1:
                        continue
                    (path,) = names[key]
                    actual = overrides.get(path, leaves[path])
                    if not _same(_value(printed), actual):
                        wrong.append(f"{page.name}: prints `{key} {printed}`, runs with {actual!r}")
    assert not wrong, "\n".join(wrong)


def _statuses() -> dict[int, str]:
    hook = _hook("exit_statuses")
    return {code: meaning for code, (_, meaning) in hook.statuses(hook.ERRORS.read_text()).items()}


def test_every_exit_status_a_page_names_is_defined():
    pattern = r"\bexit(?:s| status| code| with)? \**(\d+)"
    named = {
        (page.name, int(code)) for page in PAGES for code in re.findall(pattern, page.read_text())
    }
    known = set(_statuses()) | CONVENTIONAL_STATUSES
    assert not sorted(n for n in named if n[1] not in known)


def test_the_troubleshooting_table_lists_every_exit_status_with_its_meaning(tmp_path):
    """The generated rows hold each status of `towerflow/errors.py` and its comment."""
    hook = _hook("exit_statuses")
    page = (DOCS / "troubleshooting.md").read_text()
    assert hook.MARKER in page
    rows = hook.rows()
    for code, meaning in _statuses().items():
        assert f"| {code} | {meaning} |" in rows
    handwritten = re.findall(r"^\| (\d+) \|", page, re.M)
    assert {int(c) for c in handwritten} <= CONVENTIONAL_STATUSES, handwritten


def _command_lines(text: str):
    """Each command line of a page's ```sh and ```text blocks (continuations joined) and of
    its inline code (`python -m trainer.launch --workers=MIN:MAX`)."""
    lines = []
    for block in re.findall(r"```(?:sh|text|bash)\n(.*?)```", text, re.S):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)
    for line in lines:
        line = line.removeprefix("$ ").split("  #")[0].strip()
        if re.match(r"(python -m trainer(\.\w+)*|towerflow)(\s|$)", line):
            yield line


def _flag_errors(line: str) -> list[str]:
    try:
        args = shlex.split(line)
    except ValueError:
        return []
    command = "towerflow" if args[0] == "towerflow" else " ".join(args[:3])
    if command not in command_flags():
        return [f"`{command}` is not a command"]
    errors = []
    owner = command
    for arg in args[1 if args[0] == "towerflow" else 3 :]:
        if arg == "--":
            owner = TRAINER if command.rsplit(".", 1)[-1] in PASS_THROUGH else owner
            continue
        name = re.match(r"--([a-z_0-9]+)", arg)
        if not name or arg.startswith(("--config.", "--sweep.")):
            continue
        if name.group(1) not in command_flags()[owner] | ABSL_FLAGS:
            errors.append(f"`{arg}` of `{owner}`")
    return errors


def test_every_flag_of_a_command_line_exists_for_its_command():
    wrong = [
        f"{page.name}: {error}"
        for page in PAGES
        for line in _command_lines(page.read_text())
        for error in _flag_errors(line)
    ]
    assert not wrong, "\n".join(wrong)


def test_every_flag_a_page_names_exists_for_some_command():
    every = set().union(*command_flags().values()) | ABSL_FLAGS | FOREIGN_FLAGS
    wrong = [
        f"{page.name}: `--{name}`"
        for page in PAGES
        for name in re.findall(r"`--([a-z][a-z_0-9]*)\b(?![.])", page.read_text())
        if name not in every
    ]
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_the_flags_reference_lists_every_flag_of_every_command():
    hook = _hook("flags_reference")
    read = hook.read_all()
    page = hook.reference(read)
    for command, found in read.items():
        assert f"## `{command}`" in page
        for flag in found["flags"]:
            assert f"`--{flag['name']}`" in page or f"`--[no]{flag['name']}`" in page, flag


def test_a_config_field_documented_only_in_its_options_dataclass_is_in_the_reference():
    """A plugin's options may live only in its dataclass: its comments document them."""
    hook = _hook("config_reference")
    source = '''
@dataclasses.dataclass(frozen=True)
class ToyOptions:
    """`strategy.toy`."""

    # How many toys each replica gets.
    toys: int = 3
    colour: str = "red"  # the toys' colour
'''
    entries = {e.path: e.meaning for e in hook.dataclass_entries(source)}
    assert entries == {
        "strategy.toy": "",
        "strategy.toy.toys": "How many toys each replica gets.",
        "strategy.toy.colour": "the toys' colour",
    }
    configs_ = {"default.py": {"strategy": {"toy": {"toys": 3, "colour": "red"}}}}
    notes = {e.path: e for e in hook.dataclass_entries(source)}
    page = hook.reference(configs_, notes)
    assert "| `toys` | `int` | `3` | How many toys each replica gets. |" in page


def test_an_undocumented_config_field_fails_the_reference():
    hook = _hook("config_reference")
    notes = {"train": hook.Entry("train", True, "Training.")}
    try:
        hook.reference({"default.py": {"train": {"steps": 1}}}, notes)
    except ValueError as e:
        assert "`train.steps` has no comment" in str(e)
    else:
        raise AssertionError("a field without a comment was rendered")


def test_the_exit_statuses_are_read_from_their_one_module():
    source = ast.parse((REPO / pathlib.Path("towerflow/errors.py")).read_text())
    constants = {
        node.targets[0].id
        for node in source.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "").endswith("_CODE")
    }
    assert len(constants) == len(_statuses())


# Words of the project's own workshop that a user page has no use for.
INTERNAL = ("slow tier", "default tier", "other engineers", "earlier version", "the code before")


def test_user_pages_speak_of_use_not_of_the_projects_history_or_its_tests():
    found = [
        f"{page.name}:{number}: {phrase!r}"
        for page in PAGES
        for number, line in enumerate(page.read_text().lower().splitlines(), 1)
        for phrase in INTERNAL
        if phrase in line
    ]
    assert not found, "\n".join(found)


def test_every_plugin_option_is_documented_in_its_options_dataclass():
    """The reference does not depend on configs/default.py writing a plugin's options: each
    is documented where it is declared, so the options may come from the dataclasses."""
    hook = _hook("config_reference")
    declared = {}
    for root in hook.DATACLASS_ROOTS:
        for path in (hook.REPO / root).rglob("*.py"):
            declared.update({e.path: e.meaning for e in hook.dataclass_entries(path.read_text())})
    options = [p for p in hook.leaves(configs()["default.py"]) if p.startswith("strategy.")]
    options.remove("strategy.name")
    assert options
    assert not [p for p in options if not declared.get(p)]


@functools.cache
def _reference_sections() -> list[tuple[str, str]]:
    """(section, its description) of each section of the generated reference, in order."""
    page = _hook("config_reference").generated().splitlines()
    return [(line[3:].strip("`"), page[n + 2]) for n, line in enumerate(page) if line[:3] == "## "]


def test_the_reference_orders_sections_as_the_default_config_makes_them():
    names = [name for name, _ in _reference_sections()]
    plugins = [name for name in names if name.startswith("strategy.")]
    assert names.index("strategy") < names.index(plugins[0])
    assert names.index(plugins[-1]) < names.index("cluster") < names.index("cluster.elastic")
    assert names.index("train") < names.index("export") < names.index("eval")
    assert names.index("optimizer") < names.index("configs/ctr.py")


def test_the_reference_gives_a_declared_section_its_docstrings_description():
    described = dict(_reference_sections())
    assert described["strategy.pipeline"].startswith("Model parallelism")
    assert described["export"].startswith("SavedModels written while training")
    assert all(described[name] for name in described if name.startswith("strategy."))


def test_a_declaration_of_some_fields_of_a_section_leaves_its_description_alone():
    hook = _hook("config_reference")
    source = '''
@dataclasses.dataclass(frozen=True)
class ToyOptions:
    """`train`: toys while training."""

    toys: tuple[int, ...] = ()  # toys per step
'''
    entries = {e.path: (e.meaning, e.kind) for e in hook.dataclass_entries(source)}
    assert entries == {"train.toys": ("toys per step", "tuple[int, ...]")}


def test_the_reference_gives_each_field_its_declared_type():
    page = _hook("config_reference").generated()
    assert "| `profile_steps` | `tuple[int, ...]` | `()` |" in page
    assert "| `every_secs` | `float` | `0.0` |" in page
