"""A user's own task (`task.name=module:Task`): the same weights under every strategy, and
one clear line for each mistake (or the user's own traceback, where the bug is theirs)."""

import traceback

import numpy as np
import pytest

from tests import helpers
from tests.steps_two_replicas import on_two_cpus
from towerflow.errors import UserError
from trainer.loop import train


def _config(task: str, strategy: str = "one_device", **overrides):
    return helpers.tiny_config(
        **{
            "task.name": f"tests.user_tasks:{task}",
            **on_two_cpus(strategy),  # 2 replicas split the batch and meet as 4 would
            "train.global_batch_size": 32,
            "eval.global_batch_size": 32,
            **overrides,
        }
    )


def test_same_weights_under_one_device_mirrored_and_central_storage(tmp_path):
    weights, results = {}, {}
    for strategy in ("one_device", "mirrored", "central_storage"):
        model_dir = tmp_path / strategy
        results[strategy] = train.train_and_evaluate(_config("DictTask", strategy), str(model_dir))
        weights[strategy] = helpers.checkpoint_values(model_dir)
    for strategy in ("mirrored", "central_storage"):
        assert weights[strategy].keys() == weights["one_device"].keys()
        for name, value in weights["one_device"].items():
            np.testing.assert_allclose(weights[strategy][name], value, rtol=1e-5, atol=1e-6)
        assert results[strategy]["eval"]["examples"] == 64
        assert results[strategy]["eval"]["accuracy"] == pytest.approx(
            results["one_device"]["eval"]["accuracy"], abs=1e-6
        )


@pytest.mark.parametrize(
    "task, message",
    [
        ("Nowhere", "module 'tests.user_tasks' has no 'Nowhere'"),
        ("NoDataset", "has no `dataset_fn`"),
        ("Uncompiled", "is not compiled, and the task has no `loss`"),
        ("WrongKeys", "the model's inputs `image`"),
        ("ScalarLoss", "one loss per example"),
    ],
)
def test_a_mistake_in_a_task_is_one_line_and_model_dir_untouched(task, message, tmp_path):
    model_dir = tmp_path / "run"
    with pytest.raises(UserError, match=message) as caught:
        train.train_and_evaluate(_config(task), str(model_dir))
    assert "\n" not in str(caught.value)
    assert not model_dir.exists()


def test_a_task_path_that_does_not_import_is_one_line(tmp_path):
    config = helpers.tiny_config(**{"task.name": "no_such_package.tasks:Task"})
    with pytest.raises(UserError, match="no module 'no_such_package'"):
        train.train_and_evaluate(config, str(tmp_path / "run"))


def test_a_bug_in_the_users_pipeline_keeps_its_traceback(tmp_path):
    with pytest.raises(TypeError, match="bug in the user's pipeline") as caught:
        train.train_and_evaluate(_config("broken_dataset_fn"), str(tmp_path / "run"))
    assert not isinstance(caught.value, UserError)
    assert "dataset_fn" in [f.name for f in traceback.extract_tb(caught.value.__traceback__)]
