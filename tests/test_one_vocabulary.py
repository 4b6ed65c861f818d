"""One vocabulary: no name, message or comment of the cluster's code calls a process a task.

The scan reads every module under `strategies/` and `trainer/launch/`,
`trainer/elastic.py` and the benchmark's modules (`trainer/bench/*.py`).
"task" is the user's `trainer.Task` (a user task) and what is trained (the
task's sums and metrics, which a plugin's own figures are split from); a
process of a cluster is a member. What stays besides is other
projects' own words, quoted: TensorFlow's `TF_CONFIG` `task` key, its
`task_type` / `task_index` / `task_id` (a role is a task type), a
`tf.DeviceSpec`'s `.task` and a device name's `/task:`; Slurm's tasks
(`SLURM_NTASKS`, a Slurm task, tasks per node); Linux's `taskset` command and
a process's threads, `/proc/<pid>/task`; the variable `JOBSET_TASKS`
and the config field `cluster.ps_tasks`, the old names of `JOBSET_MEMBERS`
and `cluster.ps_members` accepted for one release; and `towerflow.errors`'
own names, which that module renames. No page a user reads (README, docs/,
deploy/, BUILD.md) calls a ps member a ps task.

One word per concept besides, as `strategies/base.py`'s glossary settles them:
no two public classes share a name (a bare `Member`, `Plan` or `Job` only where
settled), no page or module calls a member type (`chief`, `worker`, `ps`,
`evaluator`) a role or a job, and the glossary and docs/concepts.md define
each settled word.
"""

import ast
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = sorted(
    str(path.relative_to(ROOT))
    for path in [
        *ROOT.glob("strategies/**/*.py"),
        *ROOT.glob("trainer/launch/**/*.py"),
        ROOT / "trainer/elastic.py",
        *ROOT.glob("trainer/bench/*.py"),
    ]
)
# Old names kept one release as plain aliases (`old = new  # renamed`) for callers elsewhere.
ALIASES: set[str] = set()

ALLOWED = re.compile(
    "|".join(
        [
            r"task\s+types?|task_types?|TASK_TYPES",  # TensorFlow's name for a role
            r"task\s+index|task_index|task_id",  # TensorFlow's `ClusterResolver` names
            r"`task(\.\w+)?`|\"task\"|'task'|task_key|TASK_KEY",  # `TF_CONFIG`'s `task` key
            r"/task:",  # TensorFlow's device names: `/job:ps/task:0/device:CPU:0`
            # The user's `trainer.Task`: a class of one, its config section's fields.
            r"\w+Task\b|\"task\.\w+\"",
            r"Slurm\s+tasks?|SLURM_\w*TASKS\w*|tasks[_-]per[_-]node",  # Slurm's own tasks
            r"\"JOBSET_TASKS\"",  # the old name of `JOBSET_MEMBERS`, a string key
            r"\"ps_tasks\"",  # the old name of `cluster.ps_members`, a string key
            r"user\s+task",  # the user's `trainer.Task`: "a user task's own `train_step`"
            r"task(?:'s\s+|_)(?:sums|metrics)",  # what the train step returns for the task
            r"\btaskset\b",  # Linux's command that pins a process to cores
            # Linux's threads of a process; Python 3.12 tokenizes an f-string's "/task" apart
            r"/proc/(?:\{\w+\}|\d+|self)/task\b|^/task$",
        ]
    ),
    re.IGNORECASE,
)
_TASK = re.compile(r"task", re.IGNORECASE)
_ALIAS = re.compile(r"^\s*(\w+) = \w+  # renamed$")
# Python 3.12 splits an f-string into parts; its text is FSTRING_MIDDLE.
_TEXT = {tokenize.NAME, tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)}


def task_words(source: str) -> list[tuple[int, str]]:
    """(line, token) of each name, string or comment of `source` that calls something a task.

    Words in `ALLOWED` are taken out first; an attribute `.task` is TensorFlow's
    (a `tf.DeviceSpec`'s); a line `old = new  # renamed` with `old` in `ALIASES`
    is skipped.
    """
    lines = source.splitlines()
    found = []
    previous = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        after_dot, previous = previous is not None and previous.string == ".", token
        if token.type not in _TEXT or (after_dot and token.string == "task"):
            continue
        alias = _ALIAS.match(lines[token.start[0] - 1])
        if alias and alias[1] in ALIASES:
            continue
        if _TASK.search(ALLOWED.sub("", token.string)):
            found.append((token.start[0], token.string))
    return found


@pytest.mark.parametrize("path", SCANNED)
def test_no_name_or_message_in_the_cluster_modules_calls_a_process_a_task(path):
    found = task_words((ROOT / path).read_text())
    assert not found, f"{path} calls a process a task (say member): " + "; ".join(
        f"line {line}: {text[:80]!r}" for line, text in found
    )


def test_the_scan_finds_a_process_called_a_task_and_spares_tensorflows_and_slurms_words():
    wrong = [
        "lost_tasks = []",
        "def _task_of(rank): pass",
        "raise UserError('wait for the other tasks')",
        "# a server task holds variables",
        'f"this task {name}"',
        "ps_tasks = section['ps_members']",
        "# the variables that a ps task holds",
        "for task in self.tasks: pass",
    ]
    for line in wrong:
        assert task_words(line + "\n"), line
    right = [
        "task_type, task_index = spec.task_type, spec.task_index",
        "entry = config.get('task')  # `TF_CONFIG`'s `task` key",
        "raise UserError('`task.index` is 2; use one of the task types')",
        "total = environ['SLURM_STEP_NUM_TASKS']  # the step's Slurm tasks",
        "def member_name(self): pass",
        "if spec.job or spec.task is not None: pass",
        'RENAMED = {"ps_tasks": "ps_members"}',
        'device = f"/job:ps/task:{member}/device:CPU:0"',
        "# a user task's own `train_step` applies its own gradients",
        "task_sums = {k: v for k, v in sums.items() if k not in own}  # the task's sums",
        '"""In a Slurm step, the name of its Slurm task."""',
        'pin = ["taskset", "-c", str(cpu)]  # `taskset` pins it to a core',
        'for thread in os.listdir(f"/proc/{pid}/task"): pass',
    ]
    for line in right:
        assert not task_words(line + "\n"), line


# The pages a user reads: the front page, the docs site, the deploy notes, BUILD.md; and
# the code, whose messages and docstrings they read too.
PAGES = sorted(
    str(path.relative_to(ROOT))
    for path in [ROOT / "README.md", ROOT / "BUILD.md", ROOT / "deploy/README.md"]
    + list(ROOT.glob("docs/*.md"))
    + [
        path
        for folder in ("strategies", "trainer", "towerflow", "configs", "examples")
        for path in (ROOT / folder).rglob("*.py")
    ]
)
_PS_TASK = re.compile(r"\bps[ -]tasks?\b|\bps task\(s\)", re.IGNORECASE)


@pytest.mark.parametrize("path", PAGES)
def test_no_page_calls_a_ps_member_a_ps_task(path):
    found = [
        f"line {number}: {line.strip()[:80]!r}"
        for number, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if _PS_TASK.search(line)
    ]
    assert not found, f"{path} calls a ps member a ps task: " + "; ".join(found)


def test_the_page_scan_finds_a_ps_task_in_prose():
    assert _PS_TASK.search("the table is split over the ps tasks")
    assert _PS_TASK.search("variables on 2 ps task(s)")
    assert not _PS_TASK.search("split over the ps members; the old field `cluster.ps_tasks`")


# --- one word per concept, one class per name -------------------------------------------
#
# The settled words are in `strategies/base.py`'s glossary (rendered in docs/concepts.md):
# a process of a cluster is a *member*, of a *member type* (`chief`, `worker`, `ps`,
# `evaluator`: `TF_CONFIG`'s task type); its *role* is what it does (`train`, `serve`,
# `evaluate`); a *job* is one training run (a scheduler's job is named with its scheduler);
# a *plan* is named for what it plans.

PRODUCT = sorted(
    str(path.relative_to(ROOT))
    for folder in ("strategies", "trainer", "towerflow", "configs")
    for path in (ROOT / folder).rglob("*.py")
)
# Names that say too little to stand alone: a class is named for what it is of.
UNQUALIFIED = {"Member": {"trainer/launch/plan.py"}, "Plan": set(), "Job": set()}


def classes(paths: list[str]) -> dict[str, set[str]]:
    """Public top-level class name -> the modules of `paths` that define one."""
    found: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse((ROOT / path).read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found.setdefault(node.name, set()).add(path)
    return found


def test_no_two_public_classes_share_a_name():
    shared = {name: sorted(paths) for name, paths in classes(PRODUCT).items() if len(paths) > 1}
    assert not shared, f"one class per name (name each for what it is): {shared}"


@pytest.mark.parametrize("name", sorted(UNQUALIFIED))
def test_a_bare_member_plan_or_job_class_is_only_the_settled_one(name):
    allowed = UNQUALIFIED[name]
    found = classes(PRODUCT).get(name, set())
    assert found <= allowed, (
        f"`class {name}` in {sorted(found - allowed)}: qualify it (`LaunchPlan`, `HostedMember`)"
    )


# A member type called a role or a job: "its role (chief, ...)", "TensorFlow's roles",
# "a `chief` job", `ClusterSpec`'s old `.jobs`, `Membership(serving_jobs=...)`.
_TYPE_MISNAMED = re.compile(
    r"\broles?\s*\((?:chief|task type)|\b(?:TensorFlow's|task type)\W{0,3}roles?\b"
    r"|\brole, a task type|\bRole \(task type\)"
    r"|`(?:chief|worker|ps|evaluator|dispatcher|data_worker)`\s+jobs?\b"
    r"|\.jobs\b(?!\.)|\bserving_jobs="
)
# The old names themselves, kept for a release: where they are defined and warned about.
_OLD_NAME_LINE = re.compile(r"renamed\.warn|old name of|def jobs\(")
WORDED = sorted(
    set(PRODUCT) | set(PAGES) - {"docs/online.md", "docs/progressive.md", "docs/retrieval.md"}
)


def member_type_misnamed(text: str) -> list[tuple[int, str]]:
    """(line, text) of each line of `text` that calls a member type a role or a job."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if _TYPE_MISNAMED.search(line) and not _OLD_NAME_LINE.search(line)
    ]


@pytest.mark.parametrize("path", WORDED)
def test_no_page_or_module_calls_a_member_type_a_role_or_a_job(path):
    found = member_type_misnamed((ROOT / path).read_text())
    assert not found, f"{path} calls a member type a role or a job (say member type): " + (
        "; ".join(f"line {n}: {text[:80]!r}" for n, text in found)
    )


def test_the_member_type_scan_finds_the_old_words_and_spares_the_settled_ones():
    wrong = [
        "each process first finds its role (chief, worker, ps, evaluator).",
        "Glossary (TensorFlow's roles, its task types):",
        "when the cluster has no `chief` job.",
        "chief = self.cluster.jobs['chief'][0]",
        "Membership(spec, serving_jobs=('ps', 'worker'))",
    ]
    for line in wrong:
        assert member_type_misnamed(line), line
    right = [
        "its member type (chief, worker, ps, evaluator).",
        "`strategy.membership.role`: what a member does: train, serve or evaluate",
        "the elastic job trains with at least MIN members; a Slurm job runs them",
        "chief = self.cluster.addresses['chief'][0]",
        'renamed.warn("ClusterSpec.jobs", "ClusterSpec.addresses")',
    ]
    for line in right:
        assert not member_type_misnamed(line), line


SETTLED = ("member", "member type", "role", "job", "table", "plan")


def test_the_glossary_and_the_concepts_page_define_each_settled_word():
    source = (ROOT / "strategies" / "base.py").read_text()
    glossary = ast.get_docstring(ast.parse(source)) or ""
    defined = set(re.findall(r"^- \*([^*]+)\*", glossary, re.M))
    concepts = set(re.findall(r"^- \*\*([^*]+)\*\*", (ROOT / "docs/concepts.md").read_text(), re.M))
    assert set(SETTLED) <= defined, sorted(set(SETTLED) - defined)
    assert set(SETTLED) <= concepts, sorted(set(SETTLED) - concepts)
