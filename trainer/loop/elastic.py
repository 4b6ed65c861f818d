"""Elastic `multi_worker` inside each member: save on a loss, resume, report the membership.

TensorFlow's `MultiWorkerMirroredStrategy` cannot change its group inside a
process, so a membership change is a *re-form*: the processes end and the
launcher (`trainer.launch --workers=MIN:MAX`) starts the group again at its
new size. What a member does for that (`cluster.elastic.max_workers` > 0):

- A lost member makes the survivors' step fail (a reset connection at once, a
  silent peer through the watchdog). Every worker holds the same variables
  after each completed step, so each survivor writes the state of the last
  step it completed to `model_dir/elastic/ckpt-STEP-TASK` (`survivor_save`)
  and exits with `REFORM_EXIT_CODE` (`Reform`). A step some survivors
  completed and others did not is not lost: the newest save wins.
- A member that starts restores the newest state of `model_dir`: that save
  when it is newer than the newest checkpoint (`restore`). The input position
  is the step (the sources start at the batches of a step), so no example is
  trained twice or skipped, for a deterministic pipeline.
- The global batch stays the same at every size (the optimizer sees the same
  updates); one that does not split over the replicas becomes the nearest
  one that does, said in one line (`fit_batches`).
- After the first block of a re-formed group, the chief records the re-form
  (`model_dir/elastic/reforms.json`, listed in `results.json`) and saves a
  checkpoint, after which the survivors' saves are removed; every block's
  metrics carry the membership (`members`, `replicas`, `per_replica_batch`),
  so the progress line and TensorBoard show it over time.

The launcher tells a re-formed group why and when it re-formed through the
environment variable `REFORM_VARIABLE` (JSON: `from`, `to`, `why`, `at`).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable

import ml_collections
import tensorflow as tf

from strategies.cluster.roster import REFORM_VARIABLE
from towerflow import storage
from towerflow.errors import Reform
from trainer.loop.controller import Action, Output

DIRECTORY = "elastic"  # under model_dir: the survivors' saves and reforms.json
_SAVE = re.compile(r"ckpt-(\d+)-[\w.]+\.index$")


def enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether this job is elastic (`cluster.elastic.max_workers` > 0)."""
    cluster = config.get("cluster") or {}
    return bool(cluster.get("elastic") and cluster.elastic.max_workers > 0)


def fit_batches(
    config: ml_collections.ConfigDict, replicas: int, say: Callable[[str], None]
) -> None:
    """Makes the global batches split over `replicas`: the nearest that does, in one line.

    A group re-formed at another size may not split the global batch the
    user chose (48 over 5 replicas): rather than stop, the batch becomes the
    nearest multiple of the replicas (ties: the larger), and the run says so.
    """
    parts = replicas * config.train.accumulation_steps
    for section, unit in (("train", parts), ("eval", replicas)):
        batch = config[section].global_batch_size
        if batch % unit == 0:
            continue
        lower = max(unit, batch - batch % unit)
        fitted = lower if batch - lower < lower + unit - batch else lower + unit
        config[section].global_batch_size = fitted
        say(
            f"elastic: `{section}.global_batch_size` ({batch}) does not split over {unit} "
            f"replicas: using {fitted} ({fitted // unit} each) while this group trains; the "
            "trajectory differs from a run at a size that splits it"
        )


def _directory(model_dir: str) -> str:
    return os.path.join(model_dir, DIRECTORY)


def survivor_save(checkpoint: tf.train.Checkpoint, model_dir: str, step: int, task: str) -> str:
    """Writes this survivor's state (the step it completed) beside the others'; its path.

    Each survivor writes its own files (`ckpt-STEP-worker1`), so none waits on
    another or on the lost member; they hold the same values at the same step.
    """
    prefix = os.path.join(_directory(model_dir), f"ckpt-{step}-{task.replace(':', '')}")
    tf.io.gfile.makedirs(_directory(model_dir))
    return checkpoint.write(prefix)


def newest_save(model_dir: str) -> tuple[int, str] | None:
    """(step, path) of the newest survivor's save in `model_dir`; None if there is none."""
    found = []
    for name in _listed(model_dir):
        match = _SAVE.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(_directory(model_dir), name[:-6])))
    return max(found) if found else None


def _listed(model_dir: str) -> list[str]:
    directory = _directory(model_dir)
    return tf.io.gfile.listdir(directory) if tf.io.gfile.isdir(directory) else []


def restore(checkpointer, model_dir: str) -> str | None:
    """Restores the newest state: a survivor's save newer than the newest checkpoint, or that."""
    saved = newest_save(model_dir)
    latest = re.search(r"-(\d+)$", checkpointer.latest or "")
    if saved and saved[0] > (int(latest.group(1)) if latest else -1):
        return checkpointer.restore(saved[1])
    return checkpointer.restore()


class CountedStep:
    """The train step, counting the steps whose update reached every variable.

    The optimizer's own counter (`iterations`) does not wait for the update:
    in a step that fails in its all-reduce it may already count the step the
    variables never got. This count is taken after every variable's update
    (reads of them, which come after their writes), so a survivor saves the
    variables with the step they hold. Everything else is the inner step's.

    Args:
      step: the train step (`steps.TrainStep`), called in each local replica.
      first_step: the step training starts from in this process.
      replicas_here: the replicas of this process (each counts every step).
    """

    def __init__(self, step, first_step: int, replicas_here: int):
        self._inner = step
        self._first_step = first_step
        self._replicas_here = max(1, replicas_here)
        # Outside the strategy's scope: a variable of this process alone, no collective.
        self._done = tf.Variable(0, dtype=tf.int64, trainable=False, name="elastic_steps_done")

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def __call__(self, batch) -> dict:
        """One step of the inner step, then the count, once every variable holds the update."""
        sums = self._inner(batch)
        with tf.control_dependencies([tf.convert_to_tensor(v) for v in self._inner.variables]):
            self._done.assign_add(1)
        return sums

    @property
    def completed(self) -> int:
        """The step every variable holds: the first step plus the steps completed since."""
        return self._first_step + int(self._done.numpy()) // self._replicas_here


def reform(
    why: str, checkpoint: tf.train.Checkpoint, model_dir: str, step: int, task: str, iterations
) -> Reform:
    """Saves this survivor's state after losing a member (`why`); the `Reform` to exit with.

    Args:
      why: who was lost, for the line.
      checkpoint: what a checkpoint holds.
      model_dir: where the saves go (`model_dir/elastic`).
      step: the step the variables hold (`CountedStep.completed`).
      task: this process's task name, which names its save.
      iterations: the optimizer's step counter, set to `step` before the save.
    """
    start = time.monotonic()
    iterations.assign(step)
    path = survivor_save(checkpoint, model_dir, step, task)
    return Reform(
        f"elastic: {why}: saved step {step} to {path} in {time.monotonic() - start:.2f} s; "
        "the group re-forms without it"
    )


def reforms(model_dir: str) -> list[dict]:
    """Every re-form of the run in `model_dir` so far (step, from, to, why, seconds)."""
    return storage.read_json(os.path.join(_directory(model_dir), "reforms.json")) or []


def membership(
    members: int,
    replicas: int,
    global_batch: int,
    model_dir: str,
    is_chief: bool,
    save: Callable[[int], object],
    say: Callable[[str], None],
) -> Action:
    """The membership in every block's metrics; after a re-formed group's first block, its record.

    Args:
      members: worker processes in this group.
      replicas: replicas over all of them.
      global_batch: the training global batch (`fit_batches` applied).
      model_dir: where the record and the survivors' saves are.
      is_chief: whether this task writes them.
      save: the checkpointer's `save(step)` (called on every task, as the loop does).
      say: prints a line.
    """
    change = json.loads(os.environ.get(REFORM_VARIABLE) or "null")
    first = [True]

    def act(output: Output) -> None:
        output.metrics.update(
            members=members, replicas=replicas, per_replica_batch=global_batch // replicas
        )
        if not first[0]:
            return
        first[0] = False
        if change is None:
            return
        save(output.step)  # the group's state is in a checkpoint: the survivors' saves can go
        if not is_chief:
            return
        seconds = round(time.time() - change["at"], 2)
        record = {
            "step": output.step - output.steps,
            "from": change["from"],
            "to": change["to"],
            "why": change["why"],
            "seconds": seconds,
        }
        storage.write_json(
            os.path.join(_directory(model_dir), "reforms.json"), [*reforms(model_dir), record]
        )
        for name in _listed(model_dir):
            if name.startswith("ckpt-"):  # a survivor's save: the checkpoint now holds its state
                tf.io.gfile.remove(os.path.join(_directory(model_dir), name))
        say(
            f"elastic: re-formed {change['from']} -> {change['to']} members at step "
            f"{record['step']} ({change['why']}); {seconds:.1f} s from the change to this "
            "group's first block"
        )

    return Action(act, name="membership")
