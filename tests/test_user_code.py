"""A bug in the user's own code shows the user's own traceback, not a one-line config error."""

import traceback

import pytest

from tests import helpers
from towerflow.errors import UserError
from trainer.loop import train


def broken_builder(spec, config):
    """A user's model builder with a bug of its own."""
    raise ValueError("the user's builder is broken")


def test_a_users_builder_raising_valueerror_keeps_its_traceback(tmp_path):
    config = helpers.tiny_config(**{"model.name": "tests.test_user_code:broken_builder"})
    with pytest.raises(ValueError, match="the user's builder is broken") as caught:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert not isinstance(caught.value, UserError)
    frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert "broken_builder" in frames
    assert not (tmp_path / "run").exists()


def test_the_command_prints_the_users_traceback(tmp_path):
    run = helpers.run_cli(
        "--config.model.name=tests.test_user_code:broken_builder",
        f"--model_dir={tmp_path / 'run'}",
        cwd=helpers.REPO,
    )
    helpers.assert_exit(run, 1)
    assert "Traceback" in run.stderr and "broken_builder" in run.stderr
    assert "ValueError: the user's builder is broken" in run.stderr
