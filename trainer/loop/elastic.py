"""Elastic `multi_worker` inside each member: save on a loss, resume, report the membership.

TensorFlow's `MultiWorkerMirroredStrategy` cannot change its group inside a
process, so a membership change is a *re-form*: the processes end and the
launcher (`trainer.launch --workers=MIN:MAX`) starts the group again at its
new size. What a member does for that (`cluster.elastic.max_workers` > 0):

- A lost member makes the survivors' step fail (a reset connection at once, a
  silent peer through the watchdog). Every worker holds the same variables
  after each completed step, so each survivor writes the state of the last
  step it completed to `model_dir/elastic/ckpt-STEP-workerN` (`survivor_save`)
  and exits with `REFORM_EXIT_CODE` (`Reform`). A step some survivors
  completed and others did not is not lost: the newest save wins.
- A member that starts restores the newest state of `model_dir`: that save
  when it is newer than the newest checkpoint (`restore`). The input position
  is the step (the sources start at the batches of a step), so no example is
  trained twice or skipped, for a deterministic pipeline.
- The global batch stays the same at every size (the optimizer sees the same
  updates); one that does not split over the replicas becomes the nearest
  one that does, said in one line (`fit_batches`); the group runs a copy of
  the config with its batches and rate (`group_batches`, `for_group`). Under
  `cluster.elastic.batch=per_replica` the per-replica batch stays that of the
  full group (`max_workers` members) instead, and the learning rate follows
  the global batch (`keep_per_replica_batch`, `lr_rule`); the input position
  is then counted in per-replica batches of the stream (`InputPosition`).
- After the first block of a re-formed group, the chief records the re-form
  (`model_dir/elastic/reforms.json`, listed in `results.json`) and saves a
  checkpoint, after which the survivors' saves are removed; every block's
  metrics carry the membership (`members`, `replicas`, `per_replica_batch`,
  `global_batch`), so the progress line and TensorBoard show it over time.

The launcher tells a re-formed group why and when it re-formed through the
environment variable `REFORM_VARIABLE` (JSON: `from`, `to`, `why`, `at`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections.abc import Callable

import ml_collections
import tensorflow as tf

from strategies.cluster.roster import REFORM_VARIABLE
from towerflow import calls, registry, storage
from towerflow.errors import Reform, UserError
from trainer.loop.controller import Action, Output

DIRECTORY = "elastic"  # under model_dir: the survivors' saves and reforms.json
_SAVE = re.compile(r"ckpt-(\d+)-[\w.]+\.index$")
# The user's rule of `cluster.elastic.lr_scaling` ("module.path:function").
LR_RULE = calls.Signature(
    "lr_scaling", ("reference_lr", "reference_batch", "global_batch"), "the learning rate"
)
_LR_RULES = {
    "linear": lambda reference_lr, reference_batch, global_batch: (
        reference_lr * global_batch / reference_batch
    ),
    "none": lambda reference_lr, reference_batch, global_batch: reference_lr,
}


def enabled(config: ml_collections.ConfigDict) -> bool:
    """Whether this job is elastic (`cluster.elastic.max_workers` > 0)."""
    cluster = config.get("cluster") or {}
    return bool(cluster.get("elastic") and cluster.elastic.max_workers > 0)


@dataclasses.dataclass(frozen=True)
class GroupBatches:
    """What one group of replicas trains with: its global batches and peak learning rate."""

    train: int  # `train.global_batch_size` for this group
    eval: int  # `eval.global_batch_size` for this group
    learning_rate: float  # `optimizer.learning_rate` for this group


def group_batches(
    config: ml_collections.ConfigDict, replicas: int, workers: int, say: Callable[[str], None]
) -> GroupBatches:
    """The batches and rate this group of `replicas` (on `workers` members) trains with.

    The config's own unless the job is elastic: then the per-replica batch
    kept (`keep_per_replica_batch`) and batches that split over the replicas
    (`fit_batches`), each change said in one line. `config` is not changed.

    Raises:
      UserError: `cluster.elastic.lr_scaling` gave no positive rate.
    """
    train, rate = config.train.global_batch_size, config.optimizer.learning_rate
    evaluation = config.eval.global_batch_size
    if not enabled(config):
        return GroupBatches(train, evaluation, rate)
    if per_replica(config):  # each replica's batch kept, the global batch follows
        train, rate = keep_per_replica_batch(config, replicas, workers, say)
    accumulation = config.train.accumulation_steps
    train, evaluation = fit_batches(train, evaluation, replicas, accumulation, say)
    return GroupBatches(train, evaluation, rate)


def for_group(
    config: ml_collections.ConfigDict, batches: GroupBatches
) -> ml_collections.ConfigDict:
    """A copy of `config` with this group's batches and rate: the config the group runs."""
    config = config.copy_and_resolve_references()
    config.train.global_batch_size, config.eval.global_batch_size = batches.train, batches.eval
    config.optimizer.learning_rate = batches.learning_rate
    return config


def fit_batches(
    train: int, evaluation: int, replicas: int, accumulation: int, say: Callable[[str], None]
) -> tuple[int, int]:
    """The global batches (`train`, `evaluation`) made to split over `replicas`, in one line.

    A group re-formed at another size may not split the global batch the
    user chose (48 over 5 replicas): rather than stop, the batch becomes the
    nearest multiple of the replicas (x `accumulation` micro-batches for
    training; ties: the larger), and the run says so.
    """
    fitted = []
    for section, batch, unit in (
        ("train", train, replicas * accumulation),
        ("eval", evaluation, replicas),
    ):
        fitted.append(batch if batch % unit == 0 else _nearest_multiple(batch, unit))
        if fitted[-1] != batch:
            say(
                f"elastic: `{section}.global_batch_size` ({batch}) does not split over {unit} "
                f"replicas: using {fitted[-1]} ({fitted[-1] // unit} each) while this group "
                "trains; the trajectory differs from a run at a size that splits it"
            )
    return fitted[0], fitted[1]


def _nearest_multiple(batch: int, unit: int) -> int:
    """The multiple of `unit` nearest `batch` (ties: the larger), at least `unit`."""
    lower = max(unit, batch - batch % unit)
    return lower if batch - lower < lower + unit - batch else lower + unit


def per_replica(config: ml_collections.ConfigDict) -> bool:
    """Whether an elastic job keeps the per-replica batch (`cluster.elastic.batch`)."""
    return enabled(config) and config.cluster.elastic.get("batch", "global") == "per_replica"


def check_batch_kept(config: ml_collections.ConfigDict, model_dir: str) -> None:
    """A run resuming in `model_dir` keeps the `cluster.elastic.batch` it was trained with.

    Under `per_replica` every checkpoint holds the input position in
    per-replica batches (`InputPosition`); under `global` (or not elastic) the
    position is the step. Either read of the other's checkpoint would be wrong.

    Raises:
      UserError: `config.json` of an earlier run in `model_dir` records the other.
    """
    recorded = storage.read_json(os.path.join(model_dir, "config.json"))
    if not recorded:
        return
    before = recorded.get("cluster", {}).get("elastic", {})
    was = before.get("batch", "global") if before.get("max_workers", 0) > 0 else "global"
    now = "per_replica" if per_replica(config) else "global"
    if was != now:
        raise UserError(
            f"`--model_dir` '{model_dir}' was trained with `cluster.elastic.batch` '{was}' (its "
            f"config.json; a non-elastic run counts as 'global'), and this run keeps '{now}', "
            f"which counts the input position otherwise; resume with "
            f"`--config.cluster.elastic.batch={was}`, or train into a new `--model_dir`."
        )


def lr_rule(reference: str) -> Callable[[float, int, int], float]:
    """The rule of `cluster.elastic.lr_scaling`: "linear", "none" or "module.path:function".

    Returns `rule(reference_lr, reference_batch, global_batch)`, the learning
    rate of a group training `global_batch` examples a step, where the full
    group trains `reference_batch` at `reference_lr`.

    Raises:
      UserError: the function cannot be found or called with those parameters.
    """
    if reference in _LR_RULES:
        return _LR_RULES[reference]
    field = "cluster.elastic.lr_scaling"
    fn = registry.resolve(
        field, reference, "a function of (reference_lr, reference_batch, global_batch)"
    )
    return calls.adapt(fn, LR_RULE, f"`{field}` '{reference}'")


def keep_per_replica_batch(
    config: ml_collections.ConfigDict, replicas: int, workers: int, say: Callable[[str], None]
) -> tuple[int, float]:
    """`batch=per_replica`: this group's global batch and learning rate, said in one line.

    The reference is the full group: `max_workers` members of this member's
    replicas, training `train.global_batch_size` examples a step (the nearest
    that splits over them, said) at `optimizer.learning_rate`. Each replica
    keeps its batch at every size, so the global batch is that times
    `replicas`, and the rate is the rule's (`lr_rule`) for it.

    Raises:
      UserError: the rule's rate is not a positive number.
    """
    elastic = config.cluster.elastic
    full = elastic.max_workers * max(1, replicas // max(1, workers))  # the full group's replicas
    asked = config.train.global_batch_size
    reference = _nearest_multiple(asked, full * config.train.accumulation_steps)
    each = reference // full
    if reference != asked:
        say(
            f"elastic: `train.global_batch_size` ({asked}) does not split over the {full} "
            f"replicas of {elastic.max_workers} members: using {reference} ({each} each) as the "
            "full group's"
        )
    reference_lr, batch = config.optimizer.learning_rate, each * replicas
    given = lr_rule(elastic.lr_scaling)(reference_lr, reference, batch)
    try:
        rate = float(given)
    except (TypeError, ValueError):
        rate = float("nan")
    if not 0 < rate < float("inf"):
        raise UserError(
            f"`cluster.elastic.lr_scaling` '{elastic.lr_scaling}' gave {given!r} for a global "
            f"batch of {batch}; it must return a positive number (the learning rate)."
        )
    say(
        f"elastic: per-replica batch {each} kept on {replicas} replicas: global batch {batch} "
        f"(the full group's: {reference}), learning rate {rate:.6g} (`lr_scaling` "
        f"{elastic.lr_scaling} of {reference_lr:g})"
    )
    return batch, rate


class InputPosition(tf.Module):
    """`batch=per_replica`: where training is in the input stream, in per-replica batches.

    The built-in sources make one stream of per-replica batches whatever the
    number of replicas; a group of R replicas trains R of them a step. Groups
    of other sizes trained other numbers a step, so the step alone does not
    say where the stream is. This holds the origin of the group that trains:
    the stream's batches before its first step, that step and its replicas.
    They stay fixed while it trains, so any save at any step (a checkpoint, a
    survivor's) holds them, and the position at step `s` is
    `batches + (s - step) * replicas`.
    """

    def __init__(self):
        super().__init__(name="elastic_input")
        self.batches = tf.Variable(0, dtype=tf.int64, trainable=False, name="batches")
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.replicas = tf.Variable(0, dtype=tf.int64, trainable=False, name="replicas")

    def start(self, step: int, replicas: int) -> int:
        """The stream's batches before `step` (the restored state's); this group's origin then."""
        before = int(self.batches.numpy()) + (step - int(self.step.numpy())) * int(
            self.replicas.numpy()
        )
        self.batches.assign(before)
        self.step.assign(step)
        self.replicas.assign(replicas)
        return before


def _directory(model_dir: str) -> str:
    return os.path.join(model_dir, DIRECTORY)


def survivor_save(checkpoint: tf.train.Checkpoint, model_dir: str, step: int, member: str) -> str:
    """Writes this survivor's state (the step it completed) beside the others'; its path.

    Each survivor writes its own files (`ckpt-STEP-worker1`), so none waits on
    another or on the lost member; they hold the same values at the same step.
    """
    prefix = os.path.join(_directory(model_dir), f"ckpt-{step}-{member.replace(':', '')}")
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


def newer_save(model_dir: str, latest: str | None) -> str | None:
    """The newest survivor's save when it is newer than the checkpoint `latest`; else None."""
    saved = newest_save(model_dir)
    step = re.search(r"-(\d+)$", latest or "")
    if saved and saved[0] > (int(step.group(1)) if step else -1):
        return saved[1]
    return None


def restore(checkpointer, model_dir: str) -> str | None:
    """Restores the newest state: a survivor's save newer than the newest checkpoint, or that."""
    return checkpointer.restore(newer_save(model_dir, checkpointer.latest))


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
    why: str, checkpoint: tf.train.Checkpoint, model_dir: str, step: int, member: str, iterations
) -> Reform:
    """Saves this survivor's state after losing a member (`why`); the `Reform` to exit with.

    Args:
      why: who was lost, for the line.
      checkpoint: what a checkpoint holds.
      model_dir: where the saves go (`model_dir/elastic`).
      step: the step the variables hold (`CountedStep.completed`).
      member: this process's member name ("worker:1"), which names its save.
      iterations: the optimizer's step counter, set to `step` before the save.
    """
    start = time.monotonic()
    iterations.assign(step)
    path = survivor_save(checkpoint, model_dir, step, member)
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
    learning_rate: float,
    model_dir: str,
    is_chief: bool,
    save: Callable[[int], object],
    say: Callable[[str], None],
) -> Action:
    """The membership in every block's metrics; after a re-formed group's first block, its record.

    Args:
      members: worker processes in this group.
      replicas: replicas over all of them.
      global_batch: the training global batch (`fit_batches` or
        `keep_per_replica_batch` applied).
      learning_rate: `optimizer.learning_rate` of this group (scaled under
        `batch=per_replica`), for the record.
      model_dir: where the record and the survivors' saves are.
      is_chief: whether this member writes them.
      save: the checkpointer's `save(step)` (called on every member, as the loop does).
      say: prints a line.
    """
    change = json.loads(os.environ.get(REFORM_VARIABLE) or "null")
    first = [True]

    def act(output: Output) -> None:
        output.metrics.update(
            members=members,
            replicas=replicas,
            per_replica_batch=global_batch // replicas,
            global_batch=global_batch,
        )
        if not first[0]:
            return
        first[0] = False
        if change is None:
            return
        save(output.step)  # the group's state is in a checkpoint: the survivors' saves can go
        if is_chief:
            step = output.step - output.steps
            _record_reform(model_dir, change, step, global_batch, replicas, learning_rate, say)

    return Action(act, name="membership")


def _record_reform(
    model_dir: str,
    change: dict,
    step: int,
    global_batch: int,
    replicas: int,
    learning_rate: float,
    say: Callable[[str], None],
) -> None:
    """Appends the re-form to `reforms.json`, drops the survivors' saves, says it (the chief)."""
    seconds = round(time.time() - change["at"], 2)
    record = {
        "step": step,
        "from": change["from"],
        "to": change["to"],
        "why": change["why"],
        "seconds": seconds,
        "global_batch": global_batch,
        "per_replica_batch": global_batch // replicas,
        "learning_rate": learning_rate,
    }
    storage.write_json(
        os.path.join(_directory(model_dir), "reforms.json"), [*reforms(model_dir), record]
    )
    for name in _listed(model_dir):
        if name.startswith("ckpt-"):  # a survivor's save: the checkpoint now holds its state
            tf.io.gfile.remove(os.path.join(_directory(model_dir), name))
    say(
        f"elastic: re-formed {change['from']} -> {change['to']} members at step "
        f"{step} ({change['why']}); {seconds:.1f} s from the change to this "
        "group's first block"
    )
