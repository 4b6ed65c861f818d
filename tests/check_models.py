"""Model builders for `tests/test_check.py`: one whose replicas drift, one that agrees."""

import keras

from trainer.layers import Dropout


def keras_dropout(spec, config):
    """An MLP with Keras's own `Dropout`: the same mask on every replica."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.Dropout(0.5, seed=1)(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))


def towerflow_dropout(spec, config):
    """The same MLP with `trainer.layers.Dropout`: masks that do not depend on the replicas."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Flatten()(inputs)
    x = keras.layers.Dense(32, activation="relu")(x)
    x = Dropout(0.5, seed=1)(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))


def plain_batchnorm(spec, config):
    """A conv net with Keras's `BatchNormalization` as a user writes it (not synchronized)."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))


def bn_dropout(spec, config):
    """Conv, BatchNorm and `trainer.layers.Dropout`: layer state updated in every step.

    Beside it, a BatchNorm on the input itself (momentum 0.99, one channel) whose
    output counts for nothing: moved by the same data whatever the weights, its
    moving mean counts its updates.
    """
    inputs = keras.Input(spec.input_shape)
    counter = keras.layers.BatchNormalization(momentum=0.99, name="update_counter")(inputs)
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.9)(x))
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(x)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.9)(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = Dropout(0.2, seed=3, name="dropout")(x)
    logits = keras.layers.Dense(spec.num_classes)(x)
    return keras.Model(inputs, logits + 0.0 * keras.ops.mean(counter, axis=(1, 2, 3))[:, None])


WORDS = ["red", "green", "blue"]


def vocabulary_dataset(input_context, split, global_batch_size):
    """`vocabulary_layers`' features, raw strings and ints; the class is the colour's index."""
    import tensorflow as tf

    ids = tf.range(480) % 3
    colour = tf.gather(tf.constant(WORDS), ids)
    features = {
        "colour": colour,
        "code": tf.gather(tf.constant([10, 20, 30], tf.int64), ids),
        "text": tf.strings.join([colour, " sky"]),
    }
    data = tf.data.Dataset.from_tensor_slices((features, ids))
    data = data.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    return data.batch(batch, drop_remainder=split == "train")


def vocabulary_layers(spec, config):
    """`StringLookup`, `IntegerLookup` and `TextVectorization`, each with a fixed vocabulary."""
    colour = keras.Input((), name="colour", dtype="string")
    code = keras.Input((), name="code", dtype="int64")
    text = keras.Input((), name="text", dtype="string")
    parts = [
        keras.layers.CategoryEncoding(4, output_mode="one_hot")(
            keras.layers.StringLookup(vocabulary=WORDS)(colour)
        ),
        keras.layers.CategoryEncoding(4, output_mode="one_hot")(
            keras.layers.IntegerLookup(vocabulary=[10, 20, 30])(code)
        ),
        keras.layers.TextVectorization(vocabulary=[*WORDS, "sky"], output_mode="multi_hot")(text),
    ]
    x = keras.layers.Concatenate()(parts)
    return keras.Model({"colour": colour, "code": code, "text": text}, keras.layers.Dense(3)(x))
