"""`python -m trainer`: train and evaluate any model under any strategy.

python -m trainer --strategy=mirrored
python -m trainer --config=configs/default.py --config.train.steps=3000
python -m trainer --list_strategies
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter quiet

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from trainer import cli  # noqa: E402

# No default here: ml_collections would read overrides from sys.argv at import time,
# outside our error handling. `cli.resolve_config_arg` supplies configs/default.py.
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Config file with `get_config()` (default: configs/default.py); fields "
    "override as --config.train.steps=500.",
    lock_config=True,
)
_STRATEGY = flags.DEFINE_string("strategy", None, "Shorthand for --config.strategy.name.")
_MODEL_DIR = flags.DEFINE_string(
    "model_dir",
    None,
    "Checkpoints, TensorBoard events, results and export. Default: runs/<config>-<strategy>.",
)
_MODE = flags.DEFINE_enum(
    "mode", "train_and_eval", ["train", "eval", "train_and_eval"], "What to run."
)
_LIST = flags.DEFINE_bool("list_strategies", False, "List the strategies and exit.")


@cli.guarded
def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    import strategies  # loaded (quietly) by `cli.guarded`

    logging.set_verbosity(logging.WARNING)  # progress lines, not TensorFlow's INFO chatter

    if _LIST.value:
        for name, description in strategies.available().items():
            print(f"{name:<16} {description}")
        return
    from trainer.train import train_and_evaluate

    config = _CONFIG.value
    if _STRATEGY.value:
        config.strategy.name = _STRATEGY.value
    model_dir = _MODEL_DIR.value or cli.default_model_dir(
        config_flags.get_config_filename(flags.FLAGS["config"]), config.strategy.name
    )
    train_and_evaluate(config, model_dir, _MODE.value)


def _parse_flags(argv: list[str]) -> list[str]:
    argv = cli.resolve_config_arg(argv)
    try:
        rest = flags.FLAGS(argv)
        _CONFIG.value.get("seed")  # a config file that failed to load raises here
    except Exception as e:  # config files and overrides raise plain errors, not flags.Error
        cli.fail(cli.flag_error(e, argv))
    return rest


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=_parse_flags)
