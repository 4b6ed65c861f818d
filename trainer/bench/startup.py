"""The `startup` case: seconds from process start to the first finished step of `python -m trainer`.

Next to `import tensorflow` alone and to the floor: import, build a model,
trace and run one step. No warm-up: a cold start is the point.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from trainer.bench import clock
from trainer.bench.harness import child, medians, note, paired, result, tail
from trainer.bench.sizes import Sizes

IMPORT_TF = "import tensorflow"
# The least a TF program does before its first step: import, build a model, trace and run it.
FLOOR = """
import tensorflow as tf, keras
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                          keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)])
optimizer = keras.optimizers.Adam()
@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, model(x)))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss
step(tf.zeros([128, 8, 8, 1]), tf.zeros([128], tf.int32)).numpy()
"""


def run(sizes: Sizes, reps: int, workdir: str) -> dict:
    """Seconds to the first finished step, and what they compare with."""
    trainer = [
        sys.executable,
        "-m",
        "trainer",
        "--mode=train",
        "--config.train.steps=2",
        "--config.train.steps_per_loop=1",
        "--config.train.export=false",
        "--config.eval.every=0",
        "--config.train.actions=trainer.bench.clock:to_file",
    ]
    runs = {
        "import_tensorflow_s": lambda: seconds_to_exit([sys.executable, "-c", IMPORT_TF], workdir),
        "floor_s": lambda: seconds_to_exit([sys.executable, "-c", FLOOR], workdir),
        "towerflow_first_step_s": lambda: seconds_to_first_step(
            trainer, tempfile.mkdtemp(dir=workdir)
        ),
    }
    samples = {name: [] for name in runs}
    for _ in range(max(reps, sizes.startup_reps)):  # no warm-up: a cold start is the point
        for name, seconds in runs.items():
            samples[name].append(seconds())
            note(f"  {name}: {samples[name][-1]:.2f}")
    figures = medians(samples)
    first = "towerflow_first_step_s"
    ratios = {
        "towerflow_first_step/floor": paired(samples, lambda r: r[first] / r["floor_s"]),
        "towerflow_first_step/import_tensorflow": paired(
            samples, lambda r: r[first] / r["import_tensorflow_s"]
        ),
    }
    return result("seconds", figures, ratios, samples)


def seconds_to_exit(command: list[str], workdir: str) -> float:
    """Seconds from starting `command` to its exit."""
    log = os.path.join(tempfile.mkdtemp(dir=workdir), "output.log")
    tic = time.perf_counter()
    with child(command, log) as process:
        process.wait()
    if process.returncode:
        raise RuntimeError(f"{command} failed: {tail(log)}")
    return time.perf_counter() - tic


def seconds_to_first_step(trainer: list[str], directory: str) -> float:
    """Seconds from starting `trainer` to the end of its first block (one step), by its clock.

    The trainer (its `model_dir`, output and marks in `directory`) has a clock
    action that writes wall-clock marks to a file; this polls the file and
    stops the trainer once the first is there.
    """
    command = [*trainer, f"--model_dir={os.path.join(directory, 'model')}"]
    marks, log = os.path.join(directory, "clock.txt"), os.path.join(directory, "output.log")
    tic = time.time()  # the child's marks are wall-clock seconds too
    with child(command, log, marks) as process:
        while not (taken := clock.read(marks)):
            if process.poll() is not None:
                raise RuntimeError(f"no finished step from {' '.join(command)}: {tail(log)}")
            time.sleep(0.01)
    return taken[0][1] - tic
