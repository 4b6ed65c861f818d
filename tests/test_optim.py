"""Optimizers: the fused update kernels give Keras's own results, under every local strategy."""

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

import strategies
from towerflow.errors import UserError
from trainer.layers import ShardedEmbedding
from trainer.loop import optim

STEPS = 5
# `mirrored` over two of the logical CPUs: its updates of mirrored variables run as over
# four, at half the tracing.
OPTIONS = {"mirrored": ml_collections.ConfigDict({"devices": "CPU:0,CPU:1"})}


def _config(name: str) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(
        {
            "name": name,
            "learning_rate": 0.05,
            "momentum": 0.9,
            "weight_decay": 0.01,
            "schedule": "constant",
            "warmup_steps": 0,
            "decay_steps": (),
            "decay_rate": 0.1,
        }
    )


STOCK = {
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.01),
    "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd": lambda: keras.optimizers.SGD(0.05),
    "adagrad": lambda: keras.optimizers.Adagrad(0.05),
    "ftrl": lambda: keras.optimizers.Ftrl(0.05),
}


def _train(
    strategy_name: str,
    make_optimizer,
    embedding: bool = False,
    kernels: list | None = None,
    table: type = keras.layers.Embedding,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A few steps of a small model (dense, or with an embedding's sparse gradient).

    Returns the weights before and after. The op types of the traced steps go
    into `kernels`, if given. `table`: the embedding layer's class.
    """
    strategy = strategies.get(strategy_name, OPTIONS.get(strategy_name))
    assert strategy.num_replicas_in_sync == {"mirrored": 2, "central_storage": 4}.get(
        strategy_name, 1
    )
    keras.utils.set_random_seed(0)
    with strategy.scope():
        if embedding:
            model = keras.Sequential(
                [keras.Input((3,), dtype="int32"), table(50, 4)]
                + [keras.layers.Flatten(), keras.layers.Dense(1)]
            )
        else:
            model = keras.Sequential(
                [keras.Input((6,)), keras.layers.Dense(8), keras.layers.Dense(1)]
            )
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)
    initial = [v.numpy() for v in model.trainable_variables]
    rng = np.random.RandomState(1)
    x = rng.randint(0, 50, (16, 3)) if embedding else rng.randn(16, 6).astype("float32")
    y = rng.randn(16, 1).astype("float32")

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    @tf.function
    def run():  # a loop in the graph: the step is traced once, not once per step
        for _ in tf.range(STEPS):
            strategy.call_for_each_replica(step, args=(tf.constant(x), tf.constant(y)))

    run()
    if kernels is not None:
        graph = run.get_concrete_function().graph.as_graph_def()
        nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
        kernels.extend(node.op for node in nodes)
    return initial, [v.numpy() for v in model.trainable_variables]


FUSED = {  # the kernel each dense update runs as
    "adam": "ResourceApplyAdam",
    "adamw": "ResourceApplyAdam",
    "momentum": "ResourceApplyKerasMomentum",
}


@pytest.mark.parametrize("strategy", ["one_device", "mirrored", "central_storage"])
@pytest.mark.parametrize("name", ["adam", "adamw", "momentum", "sgd"])
def test_fused_updates_match_keras(strategy, name):
    kernels: list[str] = []
    initial, ours = _train(
        strategy, lambda: optim.build(_config(name), total_steps=100), kernels=kernels
    )
    if name in FUSED:
        assert FUSED[name] in kernels
    _, theirs = _train(strategy, STOCK[name])
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ours[0], initial[0]), "it trained"


def _densified(keras_class: type, **options) -> keras.optimizers.Optimizer:
    """Keras's optimizer given the dense form of every gradient."""

    class Densified(keras_class):
        def apply_gradients(self, grads_and_vars):
            pairs = [(tf.convert_to_tensor(g), v) for g, v in grads_and_vars]
            return super().apply_gradients(pairs)

    return Densified(0.05, **options)


@pytest.mark.parametrize(
    "name, keras_class, options",
    [
        ("adam", keras.optimizers.Adam, {}),
        ("momentum", keras.optimizers.SGD, {"momentum": 0.9}),
        ("adagrad", keras.optimizers.Adagrad, {}),
    ],
)
def test_sparse_gradients_update_the_rows_looked_up_as_dense_ones_do(name, keras_class, options):
    # Every step looks up the same rows, so a lazy update (the rows looked up and
    # their slots) equals the dense one; Keras's own sparse path would not (it
    # adds the moments of an id looked up twice in a batch twice).
    _, ours = _train(
        "mirrored", lambda: optim.build(_config(name), total_steps=100), embedding=True
    )
    _, theirs = _train("mirrored", lambda: _densified(keras_class, **options), embedding=True)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_sharded_table_under_mirrored_reads_and_updates_only_its_rows_as_dense_keras():
    # 2 replicas (`OPTIONS`), each with its copy of the table: every copy reads and
    # writes only the rows looked up. A gather of the whole copy (`GatherV2`
    # of a dense read) made TensorFlow copy the whole table, and its slots, on
    # every read after the first row-wise update: 28 times the update's cost.
    kernels: list[str] = []
    sparse = lambda: optim.build(_config("adam"), total_steps=100)  # noqa: E731
    _, ours = _train("mirrored", sparse, embedding=True, kernels=kernels, table=ShardedEmbedding)
    assert "GatherV2" not in kernels, "no copy of a table is read whole"
    # The step (the loop's body) dedupes the rows once and computes them once (on the
    # first copy), then writes the table and Adam's 2 slots into every copy.
    assert kernels.count("Unique") == 1
    assert kernels.count("ResourceScatterUpdate") == 3 * 2
    dense = lambda: _densified(keras.optimizers.Adam)  # noqa: E731
    _, theirs = _train("mirrored", dense, embedding=True, table=ShardedEmbedding)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fused_optimizers_are_keras_optimizers():
    for name in ("adam", "adamw", "momentum", "sgd", "adagrad", "ftrl"):
        optimizer = optim.build(_config(name), total_steps=100)
        assert isinstance(optimizer, type(STOCK[name]()))


def test_adamw_decays_only_the_rows_looked_up():
    # Every step looks up the same rows: those end as Keras's dense AdamW leaves them
    # (decay included); the others keep their initial values (Keras would decay them).
    initial, ours = _train(
        "mirrored", lambda: optim.build(_config("adamw"), total_steps=100), embedding=True
    )
    _, theirs = _train(
        "mirrored", lambda: _densified(keras.optimizers.AdamW, weight_decay=0.01), embedding=True
    )
    looked_up = np.unique(np.random.RandomState(1).randint(0, 50, (16, 3)))
    others = np.setdiff1d(np.arange(50), looked_up)
    assert len(others) > 0
    np.testing.assert_allclose(ours[0][looked_up], theirs[0][looked_up], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ours[0][others], initial[0][others])
    assert not np.allclose(theirs[0][others], initial[0][others]), "Keras decays them all"
    for a, b in zip(ours[1:], theirs[1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _two_sparse_steps(optimizer) -> list[np.ndarray]:
    """Row 0's gradient, then row 1's, as `tf.IndexedSlices`; the table after each step."""
    table = tf.Variable(np.ones((4, 2), np.float32))
    optimizer.build([table])
    after = []
    for row in (0, 1):
        grad = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([row]), tf.constant([4, 2]))
        optimizer.apply_gradients([(grad, table)])
        after.append(table.numpy())
    return after


def test_dense_updates_switch_updates_every_row_as_keras_does():
    config = _config("momentum")
    assert optim.build(config, 100).sparse_updates is True  # default: the rows looked up
    sparse = _two_sparse_steps(optim.build(config, 100))
    np.testing.assert_array_equal(sparse[1][0], sparse[0][0])  # row 0 not looked up: kept
    config.sparse_updates = False
    optimizer = optim.build(config, 100)
    assert optim.like(optimizer).sparse_updates is False
    dense = _two_sparse_steps(optimizer)
    assert not np.allclose(dense[1][0], dense[0][0])  # its momentum moved row 0 again
    theirs = _two_sparse_steps(_densified(keras.optimizers.SGD, momentum=0.9))
    for a, b in zip(dense, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _traced_update(optimizer, count: int) -> tf.Graph:
    """The graph of one update of `count` variables (dense gradients) by `optimizer`."""
    variables = [tf.Variable(tf.ones([3]), name=f"v{i}") for i in range(count)]
    optimizer.build(variables)

    @tf.function(autograph=False)
    def update():
        optimizer.apply([tf.fill([3], float(i)) for i in range(count)], variables)

    return update.get_concrete_function().graph


def test_an_update_reads_the_step_counter_once_for_all_its_variables():
    """Under `parameter_server` each read on another member than the counter's is a message."""
    reads = {}
    for count in (1, 4):
        optimizer = optim.OPTIMIZERS["adam"](0.1, None)
        graph = _traced_update(optimizer, count)
        inside = {id(external): internal for external, internal in graph.captures}
        counter = inside[id(optimizer.iterations.handle)]
        reads[count] = [
            op.name
            for op in graph.get_operations()
            if op.type == "ReadVariableOp" and op.inputs[0] is counter
        ]
    assert len(reads[4]) == len(reads[1]) == 2, reads  # the updates' read, and Keras's own


def test_with_one_replica_the_gradients_reach_the_update_as_they_are():
    """Keras's sum over replicas would add an op per gradient, on the worker under
    `parameter_server` (one replica a worker), where a table's gradient made on its ps
    member would cross back and forth."""
    optimizer = optim.OPTIMIZERS["adam"](0.1, None)
    variables = [tf.Variable(tf.ones([3]))]
    optimizer.build(variables)
    kept = []

    @tf.function(autograph=False)
    def update():
        grads = [tf.ones([3])]
        summed = optimizer.sum_gradients(list(zip(grads, variables)))
        kept.append(summed[0][0] is grads[0])

    update.get_concrete_function()
    assert kept == [True]


@pytest.mark.parametrize("steps", [(-5,), (0,), (2000, 1000), (1000, 1000), (1.5,)])
def test_step_schedule_drops_that_are_not_positive_and_increasing_are_one_line(steps):
    config = _config("sgd")
    config.update(schedule="step", decay_steps=steps)
    with pytest.raises(UserError, match=r"`optimizer.decay_steps` \(.*\) must be positive") as e:
        optim.build(config, 100)
    assert "\n" not in str(e.value) and "--config.optimizer.decay_steps=" in str(e.value)


def test_step_schedule_drops_the_rate_at_each_increasing_step():
    config = _config("sgd")
    config.update(schedule="step", decay_steps=(10, 20), decay_rate=0.5)
    rate = optim.build(config, 100).learning_rate  # at step 0
    schedule = optim.schedule(config, 100)
    rates = [float(schedule(step)) for step in (0, 9, 10, 19, 20)]
    assert float(rate) == pytest.approx(0.05)
    assert rates == pytest.approx([0.05, 0.05, 0.025, 0.025, 0.0125])
