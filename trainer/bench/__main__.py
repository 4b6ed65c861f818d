"""`python -m trainer.bench`: parses the flags and runs `harness.benchmark` (see the package)."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter quiet

from absl import app, flags  # noqa: E402

from towerflow.errors import one_line  # noqa: E402
from trainer import cli  # noqa: E402
from trainer.bench import harness  # noqa: E402
from trainer.bench.sizes import CASES  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "Tiny sizes and one repetition: a smoke test.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures to this JSON file.")
_CASES = flags.DEFINE_list("cases", list(CASES), f"Cases to run, of: {', '.join(CASES)}.")
_REPS = flags.DEFINE_integer("reps", None, "Timed repetitions per contender (default 5, quick 1).")
_IN_PROCESS = flags.DEFINE_bool(
    "in_process",
    False,
    "Run the cases in this process, not each in its own (set up for the first).",
)


@cli.guarded
def main(argv: list[str]) -> None:
    """Checks the flags, runs the cases, prints the table and writes the JSON."""
    if len(argv) > 1:
        cli.fail(f"Unexpected arguments: {' '.join(argv[1:])}; see --help.")
    unknown = [c for c in _CASES.value if c not in CASES]
    if unknown or not _CASES.value:
        cli.fail(f"Unknown `--cases` {', '.join(unknown) or '(none)'}; known: {', '.join(CASES)}.")
    reps = _REPS.value if _REPS.value is not None else (1 if _QUICK.value else 5)
    if reps < 1:
        cli.fail(f"`--reps` ({reps}) must be at least 1; e.g. `--reps=3`.")
    import absl.logging

    absl.logging.set_verbosity(absl.logging.WARNING)
    results = harness.benchmark(list(_CASES.value), _QUICK.value, reps, _IN_PROCESS.value)
    print(harness.table(results), flush=True)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(results, f, indent=2)
            f.write("\n")


def parse_flags(argv: list[str]) -> list[str]:
    """Parses `argv` into absl's flags; a mistake is one line and exit status 2."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        cli.fail(one_line(e))


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=parse_flags)
