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
    """Conv, BatchNorm and `trainer.layers.Dropout`: layer state updated in every step."""
    inputs = keras.Input(spec.input_shape)
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.9)(x))
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(x)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(momentum=0.9)(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = Dropout(0.2, seed=3, name="dropout")(x)
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(x))
