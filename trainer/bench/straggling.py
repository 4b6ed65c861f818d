"""The digits job's input with one worker slowed down: a straggler, for benchmarks and tests.

A user pipeline (`trainer.data.user`) over the built-in digits data, where
the input pipeline named by `TOWERFLOW_STRAGGLER` ("PIPELINE:SECONDS")
sleeps that long before each training batch; every other pipeline, and
eval, are the built-in digits source's own. Under `parameter_server` each
worker reads its own pipeline, so worker `PIPELINE` straggles::

    TOWERFLOW_STRAGGLER=2:0.05 python -m trainer.launch --workers=3 --ps=1 -- \\
        --strategy=parameter_server --config.data.name=trainer.bench.straggling:digits \\
        --config.data.num_classes=10

The variable reaches every member of a local cluster (the launcher passes its
environment on).
"""

from __future__ import annotations

import os

import tensorflow as tf

VARIABLE = "TOWERFLOW_STRAGGLER"
CONFIG = {  # the trainer flags that read the digits through this pipeline
    "data.name": "trainer.bench.straggling:digits",
    "data.num_classes": 10,
}


def straggler() -> tuple[int, float] | None:
    """`TOWERFLOW_STRAGGLER` as (pipeline, seconds); None where it is unset or empty.

    Raises:
      ValueError: it is not "PIPELINE:SECONDS" with SECONDS >= 0.
    """
    text = os.environ.get(VARIABLE, "").strip()
    if not text:
        return None
    pipeline, _, seconds = text.partition(":")
    try:
        parsed = int(pipeline), float(seconds)
    except ValueError:
        parsed = None
    if parsed is None or parsed[0] < 0 or parsed[1] < 0:
        raise ValueError(f"{VARIABLE} ({text!r}) must be 'PIPELINE:SECONDS', e.g. '2:0.05'")
    return parsed


def digits(input_context, split, global_batch_size) -> tf.data.Dataset:
    """The built-in digits batches of `split`; the straggling pipeline's training ones late."""
    import configs.default
    from trainer import data

    source = data.get(configs.default.get_config().data)
    if split != "train":
        return source.eval_fn(global_batch_size)(input_context)
    dataset = source.train_fn(global_batch_size, seed=0)(input_context)
    slow = straggler()
    if slow and slow[0] == input_context.input_pipeline_id:
        dataset = sleeping(dataset, slow[1])
    return dataset


def sleeping(dataset: tf.data.Dataset, seconds: float) -> tf.data.Dataset:
    """`dataset`, sleeping `seconds` before each element."""
    spec = dataset.element_spec
    variant = tf.raw_ops.SleepDataset(
        input_dataset=tf.data.experimental.to_variant(dataset),
        sleep_microseconds=tf.constant(round(seconds * 1e6), tf.int64),
        output_types=[s.dtype for s in tf.nest.flatten(spec)],
        output_shapes=[s.shape for s in tf.nest.flatten(spec)],
    )
    return tf.data.experimental.from_variant(variant, spec)
