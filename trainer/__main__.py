"""`python -m trainer`: train and evaluate any model under any strategy.

    python -m trainer --strategy=mirrored
    python -m trainer --config=configs/default.py --config.train.steps=3000
    python -m trainer --list_strategies
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's C++ start-up chatter quiet

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import configs  # noqa: E402
from trainer import cli  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config", configs.path("default"), "Config file (`get_config()`); fields override as "
    "--config.train.steps=500.", lock_config=True,
)
_STRATEGY = flags.DEFINE_string("strategy", None, "Shorthand for --config.strategy.name.")
_MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "Checkpoints, TensorBoard events, results and export. "
    "Default: runs/<config>-<strategy>."
)
_MODE = flags.DEFINE_enum("mode", "train_and_eval", ["train", "eval", "train_and_eval"],
                          "What to run.")
_LIST = flags.DEFINE_bool("list_strategies", False, "List the strategies and exit.")


@cli.guarded
def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    import strategies  # after flag parsing: importing TensorFlow is slow

    if _LIST.value:
        for name, description in strategies.available().items():
            print(f"{name:<16} {description}")
        return
    from trainer.train import say, train_and_evaluate

    config = _CONFIG.value
    if _STRATEGY.value:
        config.strategy.name = _STRATEGY.value
    model_dir = _MODEL_DIR.value or cli.default_model_dir(
        config_flags.get_config_filename(flags.FLAGS["config"]), config.strategy.name
    )
    say(f"model_dir: {model_dir}")
    train_and_evaluate(config, model_dir, _MODE.value)


def _parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(cli.resolve_config_arg(argv))
    except (flags.Error, Exception) as e:  # config files and overrides raise plain errors too
        cli.fail(cli.one_line(e))


if __name__ == "__main__":
    app.run(main, argv=sys.argv, flags_parser=_parse_flags)
