"""The scalars written after each loop: values, steps and names as TensorBoard reads them."""

import math

import pytest

from tests import helpers
from trainer.loop.summaries import Summaries


def test_scalars_keep_their_values_and_steps(tmp_path):
    summaries = Summaries(str(tmp_path), enabled=True)
    big = 2**40 + 3  # beyond int32 and float32: the step must come back exact
    summaries.scalars("train", 7, {"loss": 0.25, "accuracy": 0.5})
    summaries.scalars("train", big, {"loss": 1e-3, "accuracy": float("nan")})
    summaries.scalars("train", big + 1, {"loss": 2.0})  # other names: a call of its own
    summaries.scalars("eval", 7, {"accuracy": 0.75})
    train = helpers.tensorboard_scalars(tmp_path, "", "train")
    assert train["loss"] == {7: 0.25, big: pytest.approx(1e-3), big + 1: 2.0}
    assert train["accuracy"][7] == 0.5 and math.isnan(train["accuracy"][big])
    assert helpers.tensorboard_scalars(tmp_path, "", "eval") == {"accuracy": {7: 0.75}}


def test_a_member_that_is_not_the_chief_writes_nothing(tmp_path):
    Summaries(str(tmp_path), enabled=False).scalars("train", 1, {"loss": 1.0})
    assert not list(tmp_path.iterdir())
