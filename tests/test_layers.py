"""Sharded layers: the math of one unsharded variable, in shards, without a cluster."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import strategies
from strategies import sharding
from tests.test_models import tiny_ctr_config
from towerflow.errors import UserError
from trainer.layers import Dropout, DynamicEmbedding, ShardedDense, ShardedEmbedding
from trainer.loop import train
from trainer.loop.export import export

VOCAB, WIDTH = 10, 4
IDS = tf.constant([[0.0, 3.0, 9.0], [4.0, 4.0, 7.0]])  # float ids, as the data pipeline gives them


def _dense(gradient) -> np.ndarray:
    return tf.convert_to_tensor(gradient).numpy()


def _embeddings(num_shards: int):
    """A sharded table and the one-variable `keras.layers.Embedding` it must equal."""
    init = keras.initializers.RandomUniform(-1.0, 1.0, seed=3)
    with sharding.policy("fixed", num_shards=num_shards, num_ps=num_shards):
        layer = ShardedEmbedding(VOCAB, WIDTH, embeddings_initializer=init, name="table")
        layer.build()
    reference = keras.layers.Embedding(VOCAB, WIDTH, embeddings_initializer=init)
    reference.build()
    return layer, reference


def test_embedding_is_one_table_in_shards():
    layer, reference = _embeddings(3)
    assert [tuple(w.shape) for w in layer.weights] == [(4, WIDTH), (3, WIDTH), (3, WIDTH)]
    assert [w.path for w in layer.weights] == [f"table/embeddings_{i}" for i in range(3)]
    table = np.concatenate([w.numpy() for w in layer.weights])
    np.testing.assert_array_equal(table, reference.embeddings.numpy())

    weights = tf.random.stateless_normal([1, 1, WIDTH], seed=[0, 1])
    with tf.GradientTape(persistent=True) as tape:
        out, expected = layer(IDS), reference(tf.cast(IDS, tf.int32))
        loss, reference_loss = tf.reduce_sum(out * weights), tf.reduce_sum(expected * weights)
    np.testing.assert_array_equal(out.numpy(), expected.numpy())
    grads = tape.gradient(loss, layer.trainable_variables)
    (reference_grad,) = tape.gradient(reference_loss, reference.trainable_variables)
    assert all(isinstance(g, tf.IndexedSlices) for g in grads), "sparse: only the rows used"
    np.testing.assert_allclose(
        np.concatenate([_dense(g) for g in grads]), _dense(reference_grad), atol=1e-6
    )


def test_dense_is_one_kernel_in_shards():
    init = keras.initializers.GlorotUniform(seed=1)
    with sharding.policy("fixed", num_shards=2):
        layer = ShardedDense(5, activation="relu", kernel_initializer=init, name="wide")
        layer.build((None, 7))
    reference = keras.layers.Dense(5, activation="relu", kernel_initializer=init)
    reference.build((None, 7))
    assert [w.path for w in layer.weights] == ["wide/kernel_0", "wide/kernel_1", "wide/bias"]
    kernel = np.concatenate([k.numpy() for k in layer.kernels])
    np.testing.assert_array_equal(kernel, reference.kernel.numpy())

    x = tf.random.stateless_normal([3, 7], seed=[2, 3])
    with tf.GradientTape(persistent=True) as tape:
        loss, reference_loss = tf.reduce_sum(layer(x) ** 2), tf.reduce_sum(reference(x) ** 2)
    np.testing.assert_allclose(loss.numpy(), reference_loss.numpy(), rtol=1e-5)
    *kernel_grads, bias_grad = tape.gradient(loss, layer.trainable_variables)
    expected_kernel, expected_bias = tape.gradient(reference_loss, reference.trainable_variables)
    np.testing.assert_allclose(np.concatenate(kernel_grads), expected_kernel, atol=1e-5)
    np.testing.assert_allclose(bias_grad, expected_bias, atol=1e-5)


def _model(sharded: bool) -> keras.Model:
    embedding = ShardedEmbedding if sharded else keras.layers.Embedding
    dense = ShardedDense if sharded else keras.layers.Dense
    inputs = keras.Input((3,))
    ids = inputs if sharded else keras.ops.cast(inputs, "int32")
    x = embedding(VOCAB, WIDTH, embeddings_initializer=keras.initializers.RandomNormal(seed=4))(ids)
    x = keras.layers.Flatten()(x)
    outputs = dense(2, kernel_initializer=keras.initializers.GlorotUniform(seed=5))(x)
    return keras.Model(inputs, outputs)


def test_training_steps_match_the_unsharded_model():
    with sharding.policy("fixed", num_shards=3):
        model = _model(sharded=True)
    reference = _model(sharded=False)
    assert len(model.weights) == 3 + 3 + 1 and len(reference.weights) == 3
    labels = tf.constant([0, 1])
    for net in (model, reference):
        optimizer = keras.optimizers.Adam(0.1)
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels, net(IDS))
                )
            optimizer.apply_gradients(
                zip(tape.gradient(loss, net.trainable_variables), net.trainable_variables)
            )
    table = np.concatenate([w.numpy() for w in model.weights[:3]])
    np.testing.assert_allclose(table, reference.weights[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(model(IDS).numpy(), reference(IDS).numpy(), atol=1e-5)


def test_checkpoint_and_savedmodel_hold_every_shard(tmp_path):
    with sharding.policy("fixed", num_shards=2):
        model = _model(sharded=True)
    saved = tf.train.Checkpoint(model=model).save(str(tmp_path / "ckpt" / "c"))
    keys = [name for name, _ in tf.train.list_variables(saved)]
    assert sum("embeddings_" in k for k in keys) == 2 and sum("kernel_" in k for k in keys) == 2

    with sharding.policy("fixed", num_shards=2):
        restored = _model(sharded=True)
    for w in restored.weights:
        w.assign(tf.zeros_like(w))
    tf.train.Checkpoint(model=restored).restore(saved).assert_existing_objects_matched()
    np.testing.assert_array_equal(restored(IDS).numpy(), model(IDS).numpy())

    path = export(model, str(tmp_path / "export"), (3,), 2)
    serve = tf.saved_model.load(path).signatures["serving_default"]
    np.testing.assert_allclose(serve(inputs=IDS)["logits"].numpy(), model(IDS).numpy(), atol=1e-6)


@pytest.mark.parametrize(
    "options, shape, expected",
    [
        (dict(partitioner="none"), (1000, 8), 1),
        (dict(partitioner="fixed", num_shards=3), (1000, 8), 3),
        (dict(partitioner="fixed", num_shards=3), (2, 8), 2),  # at most one row per shard
        (dict(partitioner="min_size", min_shard_bytes=1000, num_ps=2), (1000, 8), 2),  # <= ps
        (dict(partitioner="min_size", min_shard_bytes=16_000, num_ps=4), (1000, 8), 2),
        (dict(partitioner="max_size", max_shard_bytes=8_000), (1000, 8), 4),
    ],
)
def test_policies_count_shards_like_tf_partitioners(options, shape, expected):
    with sharding.policy(**options):
        assert sharding.num_shards(shape, tf.float32) == expected
    assert sharding.num_shards(shape, tf.float32) == 1, "no policy outside the block"


def test_a_dynamic_table_takes_its_parts_and_their_devices_from_the_sharding_policy():
    assert len(DynamicEmbedding(4).parts) == 1, "one part outside a policy"
    with sharding.policy("none", num_ps=3):
        assert [part.device for part in DynamicEmbedding(4).parts] == [None] * 3
    placed = sharding.Policy("fixed", num_shards=2, num_ps=2, on_ps=True)
    assert placed.part_devices() == ["/job:ps/task:0/device:CPU:0", "/job:ps/task:1/device:CPU:0"]
    twin = placed.with_parts(3)  # another split's twin: placed as the policy it came from
    assert (twin.partitioner, twin.num_ps, len(twin.part_devices())) == ("none", 3, 3)
    assert twin.part_devices()[2] == "/job:ps/task:2/device:CPU:0"


def test_split_rows_is_the_div_layout():
    assert sharding.split_rows(10, 4) == [3, 3, 2, 2]
    assert sharding.split_rows(6, 3) == [2, 2, 2]


@pytest.mark.parametrize(
    "options, expected",
    [
        (dict(partitioner="round_robin"), "Unknown `strategy.parameter_server.partitioner` "),
        (dict(partitioner="fixed", num_shards=0), "`strategy.parameter_server.num_shards` (0)"),
        (
            dict(partitioner="max_size", max_shard_bytes=0),
            "parameter_server.max_shard_bytes` (0) must be >= 1",
        ),
    ],
)
def test_bad_policies_are_user_errors(options, expected):
    with pytest.raises(UserError) as info:
        sharding.Policy(**options)
    assert expected in str(info.value)
    if "Unknown" in expected:
        assert "none, fixed, min_size, max_size" in str(info.value)


def test_ctr_model_trains_under_mirrored_as_one_table(tmp_path):
    config = tiny_ctr_config(**{"strategy.name": "mirrored", "train.global_batch_size": 32})
    results = train.train_and_evaluate(config, str(tmp_path), mode="train")  # no eval asserted
    placement = results["placement"]["variables"]
    assert [name for name in placement if "embeddings" in name] == ["embedding/embeddings_0"]
    assert (
        len(placement["embedding/embeddings_0"]) == strategies.get("mirrored").num_replicas_in_sync
    )
    assert results["step"] == config.train.steps and np.isfinite(results["train"]["loss"])


def _dropout_outputs(name: str, calls: int = 2) -> tuple[list[np.ndarray], int]:
    """`Dropout(0.5)` on a global batch of ones under strategy `name`, `calls` times.

    Returns the global batch's outputs of each call (replicas' rows in order)
    and how many replicas computed them.
    """
    strategy = strategies.get(name)
    with strategy.scope():
        layer = Dropout(0.5, seed=7)
        layer.build()
    replicas = strategy.num_replicas_in_sync
    ones = strategy.tf_strategy.experimental_distribute_values_from_function(
        lambda context: tf.ones([16 // replicas, 6])
    )

    @tf.function
    def forward(inputs):
        return strategy.call_for_each_replica(lambda x: layer(x, training=True), (inputs,))

    outputs = []
    for _ in range(calls):
        per_replica = strategy.local_results(forward(ones))
        outputs.append(np.concatenate([t.numpy() for t in per_replica]))
    assert int(layer.step.numpy()) == calls, "one count per step, whatever the replicas"
    return outputs, replicas


@pytest.mark.parametrize("name", ["mirrored", "central_storage"])
def test_dropout_masks_do_not_depend_on_how_the_batch_is_split(name):
    reference, _ = _dropout_outputs("one_device")
    outputs, replicas = _dropout_outputs(name)
    assert replicas == 4
    for got, want in zip(outputs, reference):
        np.testing.assert_array_equal(got, want)
    first, second = outputs
    assert set(np.unique(first)) == {0.0, 2.0} and 0.3 < np.mean(first == 0) < 0.7
    assert not np.array_equal(first, second), "a new mask each step"
    rows = len(first) // replicas
    assert not np.array_equal(first[:rows], first[rows : 2 * rows]), "replicas differ"
