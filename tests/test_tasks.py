"""Losses and metrics add up exactly over batches; AUC from histograms is right."""

import numpy as np
import pytest
import tensorflow as tf

from trainer.loop import objectives


def test_auc_matches_the_pairwise_definition():
    rng = np.random.RandomState(0)
    labels = rng.randint(0, 2, 2000)
    scores = np.clip(0.5 + 0.2 * (labels - 0.5) + 0.2 * rng.randn(2000), 0.001, 0.999)
    logits = np.log(np.stack([1 - scores, scores], 1))
    task = objectives.Classification(2)
    out = tf.constant(logits, tf.float32)
    sums = {
        k: v.numpy() for k, v in task.sums(labels, out, task.per_example_loss(labels, out)).items()
    }
    pos, neg = scores[labels == 1], scores[labels == 0]
    exact = np.mean(pos[:, None] > neg[None, :]) + 0.5 * np.mean(pos[:, None] == neg[None, :])
    assert task.metrics(sums)["auc"] == pytest.approx(exact, abs=0.01)
    assert 0.7 < exact < 0.9


def test_auc_extremes():
    assert objectives.auc([0, 0, 5], [5, 0, 0]) == 1.0
    assert objectives.auc([5, 0, 0], [0, 0, 5]) == 0.0
    assert objectives.auc([1, 1], [1, 1]) == 0.5


def test_sums_over_split_batches_equal_the_whole():
    rng = np.random.RandomState(1)
    labels = rng.randint(0, 10, 64)
    outputs = tf.constant(rng.randn(64, 10), tf.float32)
    task = objectives.Classification(10)

    def sums(y, o):
        return task.sums(y, o, task.per_example_loss(y, o))

    whole = sums(labels, outputs)
    halves = [sums(labels[i : i + 32], outputs[i : i + 32]) for i in (0, 32)]
    for key in whole:
        assert float(whole[key]) == pytest.approx(float(halves[0][key] + halves[1][key]), 1e-5)
    metrics = task.metrics({k: float(v) for k, v in whole.items()})
    predicted = np.argmax(outputs.numpy(), 1)
    assert metrics["accuracy"] == pytest.approx(np.mean(predicted == labels))


def test_regression_metrics():
    task = objectives.for_spec(0)
    y = tf.constant([1.0, 2.0, 4.0])
    out = tf.constant([[1.0], [3.0], [2.0]])
    sums = {k: float(v) for k, v in task.sums(y, out, task.per_example_loss(y, out)).items()}
    assert task.metrics(sums) == pytest.approx({"loss": 5 / 3, "mae": 1.0})


def test_logits_softmax_and_sigmoid_outputs_give_the_same_sums():
    """Two classes as logits [0, z], as their softmax, and as one sigmoid(z) unit."""
    rng = np.random.RandomState(2)
    labels = rng.randint(0, 2, 256)
    z = rng.randn(256, 1).astype(np.float32) * 3
    logits = tf.constant(np.concatenate([np.zeros_like(z), z], axis=1))
    outputs = {
        "logits": logits,
        "probabilities": tf.nn.softmax(logits),
        "sigmoid": tf.sigmoid(tf.constant(z)),
    }
    sums = {}
    for kind, out in outputs.items():
        task = objectives.for_spec(2, kind)
        sums[kind] = {
            k: v.numpy()
            for k, v in task.sums(labels, out, task.per_example_loss(labels, out)).items()
        }
    for kind in ("probabilities", "sigmoid"):
        for key, value in sums["logits"].items():
            np.testing.assert_allclose(sums[kind][key], value, rtol=1e-4, atol=1e-3, err_msg=key)
    assert sums["logits"]["loss"] > 10  # not a trivial comparison


def test_weights_weigh_every_sum():
    task = objectives.for_spec(3)
    labels = tf.constant([0, 1, 2, 2])
    outputs = tf.constant([[5.0, 0, 0], [5.0, 0, 0], [0, 0, 5.0], [0, 5.0, 0]])
    per_example = task.per_example_loss(labels, outputs)
    weights = tf.constant([2.0, 0.0, 1.0, 0.0])
    sums = {k: float(v) for k, v in task.sums(labels, outputs, per_example, weights, 4).items()}
    assert sums["examples"] == 4 and sums["weight"] == 3
    assert sums["correct"] == 3  # the two wrong predictions weigh 0
    assert task.metrics(sums)["accuracy"] == 1.0
    assert sums["loss"] == pytest.approx(2 * float(per_example[0]) + float(per_example[2]))
