"""Gradient accumulation (`train.accumulation_steps`): k micro-batches of B/k are one batch of B.

Without dropout, k micro-batches' summed gradients are the gradient of the
whole batch, so the weights after 20 steps match those of k = 1 to float
rounding, under every strategy; a step is still one update. The model counts
the training calls it gets and their rows, which shows the micro-batches ran.
"""

import dataclasses
import json
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import (
    checkpoint_values,
    config_flags,
    launched,
    one_line_error,
    tiny_config,
)
from trainer.loop import train

STEPS, BATCH = 20, 32


class MicroBatches(keras.layers.Layer):
    """The identity; counts its training calls and keeps the rows of the last one."""

    def build(self, input_shape):
        counter = dict(shape=(), initializer="zeros", dtype="int64", trainable=False)
        # Each replica counts its own calls (no cross-replica exchange inside the step).
        self.calls = self.add_weight(name="calls", aggregation="none", **counter)
        self.rows = self.add_weight(name="rows", aggregation="none", **counter)

    def call(self, inputs, training=False):
        if training:
            # The TF variable's own add: atomic when asynchronous workers add at once.
            self.calls.value.assign_add(1)
            self.rows.assign(tf.shape(inputs, out_type=tf.int64)[0])
        return inputs


def counting_mlp(spec, config) -> keras.Model:
    """The default MLP's shape (one hidden layer, `model.weight_decay`) with `MicroBatches`."""
    inputs = keras.Input(spec.input_shape)
    penalty = keras.regularizers.L2(config.weight_decay) if config.weight_decay else None
    hidden = keras.layers.Dense(32, activation="relu", kernel_regularizer=penalty)(
        keras.layers.Flatten()(inputs)
    )
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(MicroBatches()(hidden)))


def _config(strategy: str, k: int, **overrides):
    return tiny_config(
        **{
            "strategy.name": strategy,
            "model.name": "tests.test_accumulation:counting_mlp",
            "train.global_batch_size": BATCH,
            "train.accumulation_steps": k,
            **overrides,
        }
    )


@dataclasses.dataclass
class Run:
    weights: list[np.ndarray]  # the trainable ones
    results: dict
    model_dir: pathlib.Path
    calls: int = 0  # training calls of the model on one replica
    rows: int = 0  # rows of the last one


def _trained(config, model_dir) -> Run:
    job = train.build(config, str(model_dir))
    results = train.run(job, "train")
    run = Run([w.numpy() for w in job.model.trainable_weights], results, model_dir)
    counters = [layer for layer in job.model.layers if isinstance(layer, MicroBatches)]
    if counters:
        run.calls, run.rows = int(counters[0].calls.numpy()), int(counters[0].rows.numpy())
    return run


def _assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def one_batch(tmp_path_factory) -> Run:
    """20 steps of one batch of 32 under `one_device`: the reference."""
    return _trained(_config("one_device", 1), tmp_path_factory.mktemp("k1"))


@pytest.mark.parametrize("strategy,k", [("one_device", 4), ("mirrored", 2), ("central_storage", 2)])
def test_micro_batches_give_the_weights_of_one_batch(strategy, k, one_batch, tmp_path):
    """mirrored and central_storage: 4 replicas of 8 examples, each as 2 micro-batches of 4."""
    run = _trained(_config(strategy, k), tmp_path)
    replicas = 1 if strategy == "one_device" else 4
    assert (one_batch.calls, one_batch.rows) == (STEPS, BATCH)
    assert (run.calls, run.rows) == (STEPS * k, BATCH // replicas // k)
    _assert_same(run.weights, one_batch.weights)
    assert run.results["step"] == STEPS  # steps count updates
    # The step's sums add up over micro-batches: the same loss and accuracy as one batch.
    for name in ("loss", "accuracy"):
        assert run.results["train"][name] == pytest.approx(one_batch.results["train"][name])


@pytest.mark.slow  # two mirrored runs
def test_micro_batches_with_clipping_and_a_regulariser(tmp_path, capsys):
    """The regulariser counts once per update and clipping sees the whole batch's gradient."""
    extra = {"model.weight_decay": 1e-2, "optimizer.clip_global_norm": 0.5}
    one = _trained(_config("mirrored", 1, **extra), tmp_path / "one")
    micro = _trained(_config("mirrored", 4, **extra), tmp_path / "micro")
    assert micro.rows == 2
    assert "| global batch: 32 (4 micro-batches of 8)" in capsys.readouterr().out
    _assert_same(micro.weights, one.weights)


@pytest.mark.parametrize(
    "option", [{"train.jit_compile": True}, {"train.precision": "mixed_float16"}]
)
def test_micro_batches_under_xla_and_loss_scaling(option, one_batch, tmp_path):
    one = _trained(_config("one_device", 1, **option), tmp_path / "one")
    micro = _trained(_config("one_device", 4, **option), tmp_path / "micro")
    assert (micro.calls, micro.rows, micro.results["step"]) == (STEPS * 4, BATCH // 4, STEPS)
    # float16 rounds the activations (and XLA may fuse) differently for another batch size.
    for a, b in zip(micro.weights, one.weights):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_a_users_compiled_task_with_dict_features_and_sparse_gradients(tmp_path):
    """The user's Keras loss and metrics, an `Embedding` (sparse gradients), named inputs."""
    task = {
        "task.name": "tests.user_tasks:DictTask",
        "optimizer.name": "sgd",
        # Two replicas (half the tracing of four): each still splits its batch in two.
        "strategy.mirrored.devices": "CPU:0,CPU:1",
    }
    one = _trained(_config("mirrored", 1, **task), tmp_path / "one")
    micro = _trained(_config("mirrored", 2, **task), tmp_path / "micro")
    _assert_same(micro.weights, one.weights)
    for name in ("loss", "accuracy"):
        assert micro.results["train"][name] == pytest.approx(one.results["train"][name])


def test_a_batch_that_does_not_split_into_micro_batches_is_one_line(tmp_path):
    config = _config("mirrored", 3)  # 32 over 4 replicas x 3 micro-batches
    message = one_line_error("accumulation_steps", train.build, config, str(tmp_path / "run"))
    assert "(3) x the 4 replica(s) of `mirrored` (12)" in message and "use 24 or 36" in message
    assert not (tmp_path / "run").exists()


def test_a_tasks_own_train_step_is_not_split_in_one_line(tmp_path):
    config = _config("one_device", 2, **{"task.name": "examples.custom_step:ConsistencyTask"})
    message = one_line_error("train_step", train.build, config, str(tmp_path / "run"))
    assert "`train.accumulation_steps` (2)" in message
    assert not (tmp_path / "run").exists()


# The fields `tiny_config` and `_config` set, passed to a cluster's trainers as flags.
_FIELDS = (
    "model.name",
    "model.hidden_units",
    "model.dropout",
    "train.steps",
    "train.steps_per_loop",
    "train.checkpoint_every",
    "train.global_batch_size",
    "train.accumulation_steps",
    "train.export",
    "eval.every",
)


def _counters(values: dict) -> dict:
    """A checkpoint's `MicroBatches` counters: the model's int64 variables, in model order."""
    ints = {k: v for k, v in values.items() if k.startswith("variables/") and v.dtype == np.int64}
    order = sorted(ints, key=lambda key: int(key.split("/")[1]))
    return dict(zip(("calls", "rows"), (int(ints[key]) for key in order)), keys=set(order))


@pytest.mark.slow  # a cluster; in-process strategies show the same accumulation
def test_two_workers_accumulate_then_all_reduce_once(one_batch, tmp_path):
    """multi_worker, 2 local worker processes: each runs 2 micro-batches of 8 a step."""
    launched(
        "--workers=2",
        "--",
        "--strategy=multi_worker",
        "--model_dir=mw",
        *config_flags(_config("multi_worker", 2), _FIELDS),
        cwd=str(tmp_path),
    )
    got, want = checkpoint_values(tmp_path / "mw"), checkpoint_values(one_batch.model_dir)
    assert got.keys() == want.keys() and len(got) > 5
    counters = _counters(got)
    assert (counters["calls"], counters["rows"]) == (STEPS * 2, BATCH // 2 // 2)
    for name in set(got) - counters["keys"]:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert json.loads((tmp_path / "mw" / "results.json").read_text())["step"] == STEPS


@pytest.mark.slow  # a cluster
def test_async_parameter_server_updates_once_per_step(tmp_path):
    """2 workers and 1 ps: each step runs 4 micro-batches on a worker and pushes one update."""
    launched(
        "--workers=2",
        "--ps=1",
        "--",
        "--strategy=parameter_server",
        "--model_dir=ps",
        *config_flags(_config("parameter_server", 4), _FIELDS),
        cwd=str(tmp_path),
    )
    values = checkpoint_values(tmp_path / "ps")
    assert int(values["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"]) == STEPS
    counters = _counters(values)
    assert (counters["calls"], counters["rows"]) == (STEPS * 4, BATCH // 4)
