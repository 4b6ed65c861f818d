"""Optimizers and learning-rate schedules by name.

`build(config.optimizer, total_steps)` returns a Keras optimizer whose
learning rate follows a warmup then a constant, cosine or step schedule.

The optimizers are Keras's own, with the same variables, checkpoints and
arithmetic, but each variable's update runs as one fused TensorFlow kernel
(`ResourceApplyAdam`, `ResourceApplyKerasMomentum`): one pass over the
variable and its slots instead of one per elementwise op. On a 15M-parameter
model that cuts Adam's update from 25 ms to 6 ms a step on 2 CPU cores.
Options the kernels lack take Keras's own path.

Sparse gradients (`tf.IndexedSlices`, from an embedding lookup) update only
the rows they name and those rows' slots (Adam "lazily": the moments of rows
not looked up stay as they are), where Keras's Adam, momentum SGD, Adagrad
and FTRL would update every row of the table each step. Rows named twice are
summed first. The rows of a `DynamicEmbedding` are first reset, with their
slots, wherever the table gave a slot to a new id (see `trainer.layers.tables`).
These optimizers train such a table in plain Keras too (`model.fit`, a
`tf.GradientTape` loop); Keras's own classes are refused there
(`trainer.layers.table_training`). A table that names its own optimizer
(`TableOptimizer`) is updated by one built for it, inside this one.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator

import keras
import ml_collections
import tensorflow as tf

from strategies import tf_patches, tf_private
from towerflow.errors import UserError
from trainer.layers import table_training, tables


def _handle(variable) -> tf.Tensor:
    """The resource handle of a Keras or TF variable (this device's copy, in an update)."""
    return (variable.value if isinstance(variable, keras.Variable) else variable).handle


def _dense(gradient) -> bool:
    return not isinstance(gradient, tf.IndexedSlices)


def _gather(variable, indices: tf.Tensor) -> tf.Tensor:
    """Rows `indices` of `variable` (this device's copy, in an update), read alone.

    Through the copy's handle, as `_put` writes: `tf.gather` of a distributed
    variable (under `mirrored`, every slot) reads the whole copy and gathers
    from that, and the scatter that follows must then copy the whole buffer it
    shares with the read: three full copies of a 200,000-row table's variable
    and slots per replica, 28 times the sparse update's own cost.
    """
    return tf.raw_ops.ResourceGather(
        resource=_handle(variable), indices=indices, dtype=variable.dtype
    )


def _put(variable, indices: tf.Tensor, rows: tf.Tensor) -> tf.Operation:
    """Writes `rows` into rows `indices` of `variable` (this device's copy, in an update).

    Through the copy's handle, as the fused updates write: a distributed
    variable's own `scatter_update` refuses any aggregation but "none", and
    optimizer slots under `mirrored` and `multi_worker` have "mean" (see
    `strategies.mirrored.replica_state_averaged`).
    """
    rows = tf.cast(rows, variable.dtype)
    write = tf.raw_ops.ResourceScatterUpdate(
        resource=_handle(variable), indices=indices, updates=rows
    )
    if _WRITES:
        _WRITES[-1].append((variable, indices, rows))
    return write


# The writes of the update being traced (`_put`), for `_SparseRows._update_copies`; one
# update's copies are traced one after another in one thread (the strategy's merge call).
_WRITES: list[list[tuple]] = []


@contextlib.contextmanager
def _writes_recorded() -> Iterator[list[tuple]]:
    """Inside, `_put` adds each `(variable, indices, rows)` it writes to the list yielded."""
    _WRITES.append([])
    try:
        yield _WRITES[-1]
    finally:
        _WRITES.pop()


class _SparseRows:
    """Sparse gradients update only the rows they name, and those rows' slots.

    Mixed into every optimizer here; each gives its update of some rows
    (`_update_rows`) and the slots that belong to a variable (`_slots_of`).
    With `sparse_updates` False (`optimizer.sparse_updates`), the gradient of a
    static table is made dense first and every row is updated, as Keras does;
    a `DynamicEmbedding`'s rows stay sparse (their new rows must be reset).
    """

    sparse_updates = True
    options = None  # the `optimizer` config section (momentum, ...), for the tables' own
    _routes_tables = True  # False in a table's own optimizer: it trains what it is given
    _table_optimizers: dict = {}  # (until built)
    _built_on: list = []
    _step_read = None  # the step counter, read once while an update is traced

    def build(self, var_list):
        """Builds on `var_list`, handing the rows of a table with its own optimizer to it.

        Each table whose layer names its own `table_optimizer` gets one,
        tracked as this optimizer's `table_<layer name>` (its slots are
        checkpointed with this optimizer's). Every table's clock is this
        optimizer's step.
        """
        if self.built:
            return
        var_list = list(var_list)
        # Untracked (Keras would track the variables, TF the dict's keys as names).
        object.__setattr__(self, "_table_optimizers", {})  # variable key -> the table's own
        object.__setattr__(self, "_built_on", var_list)
        # The update steps below call `super()` once traced: outside the trainer too (plain
        # Keras), that call must not keep the tracing stack (and its input iterators) alive.
        tf_patches.super_leaves_no_frames()
        owned: dict = {}
        for variable in var_list:
            owner = tables.owner_of(variable) if self._routes_tables else None
            if owner is not None and owner.layer.table_optimizer.is_own:
                owned.setdefault(owner.layer.name, (owner.layer, []))[1].append(variable)
        for name, (layer, rows) in owned.items():
            own = self._table_optimizer(layer.table_optimizer)
            own.build(rows)
            setattr(self, f"table_{name}", own)  # tracked: checkpointed with this one
            self._table_optimizers.update((tf_private.variable_key(self, v), own) for v in rows)
        super().build(
            [v for v in var_list if tf_private.variable_key(self, v) not in self._table_optimizers]
        )
        for variable in var_list:
            owner = tables.owner_of(variable)
            if owner is not None:
                trainer = self.trainer_of(variable)
                slots = trainer._slots_of(tf_private.variable_index(trainer, variable))
                owner.trained_by(self.iterations, len(slots))

    def trainer_of(self, variable) -> keras.optimizers.Optimizer:
        """The optimizer that updates `variable`: a table's own, or this one."""
        return self._table_optimizers.get(tf_private.variable_key(self, variable), self)

    def _table_optimizer(self, own: table_training.TableOptimizer) -> keras.optimizers.Optimizer:
        """A table's own optimizer: its kind (or this one's) at its rate, on this one's schedule."""
        rate = tf_private.learning_rate_of(self)
        if own.learning_rate is not None:
            if isinstance(rate, WarmupSchedule):
                rate = WarmupSchedule(**{**rate.get_config(), "peak": own.learning_rate})
            else:
                rate = own.learning_rate
        elif not isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            rate = float(rate.numpy())
        if own.name is None:
            table = type(self).from_config({**self.get_config(), "learning_rate": rate})
        else:
            table = OPTIMIZERS[own.name](rate, self.options or _TABLE_DEFAULTS)
        table._routes_tables = False
        table.sparse_updates = self.sparse_updates
        # It counts a step with the model's optimizer, each step; asynchronous parameter-server
        # workers step at once, and the plugin only sees the model optimizer's counter.
        tf_patches.count_steps_atomically(table.iterations)
        return table

    def apply(self, grads, trainable_variables=None):
        variables = self._built_on if trainable_variables is None else list(trainable_variables)
        if trainable_variables is not None and not self.built:
            self.build(variables)
            self.built = True
        mine, theirs = [], {}
        for grad, variable in zip(grads, variables, strict=True):
            trainer = self.trainer_of(variable)
            pairs = mine if trainer is self else theirs.setdefault(id(trainer), (trainer, []))[1]
            pairs.append((grad, variable))
        # Keras would apply the rows' constraint, which refuses an optimizer not row-aware.
        with table_training.constraints_lifted(variables):
            result = super().apply([g for g, _ in mine], [v for _, v in mine])
            for trainer, pairs in theirs.values():
                trainer._summed_by_caller = self._summed_by_caller
                trainer.apply([g for g, _ in pairs], [v for _, v in pairs])
        return result

    def update_variables(self, distribution, grads_and_vars, learning_rate):
        # Keras's loop, each variable's copies updated by `_update_copies`, all of them
        # with the step read once (`_next_step`).
        self._step_read = tf.convert_to_tensor(self.iterations)
        try:
            self._update_each(distribution, grads_and_vars, learning_rate)
        finally:
            self._step_read = None

    def _next_step(self, dtype) -> tf.Tensor:
        """The step this update makes (the counter + 1), in `dtype`.

        Read once for every variable of an update: under `parameter_server` each
        read on another member than the counter's is a message each step.
        """
        step = self.iterations if self._step_read is None else self._step_read
        return tf.cast(step + 1, dtype)

    def _update_each(self, distribution, grads_and_vars, learning_rate) -> None:
        for grad, variable in grads_and_vars:
            update = self._update_copies()
            distribution.extended.update(variable, update, args=(grad, learning_rate), group=False)

    def _update_copies(self) -> Callable:
        """The update of each copy of one variable (`mirrored`: one per replica), in turn.

        The first copy's row-wise update runs whole: dedupe the rows, gather
        them and their slots, compute. Each other copy, whose rows and
        gradient are the first's, only writes the rows the first wrote (a
        scatter per variable or slot), instead of computing them again.
        Dense updates (fused kernels) run on every copy.
        """
        first: dict = {}

        def update(copy, gradient, learning_rate):
            if not first:
                with _writes_recorded() as writes:
                    result = self.update_step(gradient, copy, learning_rate)
                first.update(copy=copy, writes=writes)
                return result
            if not first["writes"]:  # a dense update
                return self.update_step(gradient, copy, learning_rate)
            for variable, indices, rows in first["writes"]:
                _put(copy if variable is first["copy"] else variable, indices, rows)
            return None

        return update

    def update_step(self, gradient, variable, learning_rate):
        if _dense(gradient):
            return super().update_step(gradient, variable, learning_rate)
        indices, inverse = tf.unique(gradient.indices)
        values = tf.math.unsorted_segment_sum(
            tf.cast(gradient.values, variable.dtype), inverse, tf.size(indices)
        )
        index = tf_private.variable_index(self, variable)
        owner = tables.owner_of(tf_private.built_variables(self)[index])
        if owner is None and not self.sparse_updates:
            return super().update_step(tf.convert_to_tensor(gradient), variable, learning_rate)
        if owner is not None:
            self._reset_new_rows(owner, variable, index, indices)
        self._update_rows(values, indices, variable, index, tf.cast(learning_rate, variable.dtype))

    def _reset_new_rows(self, owner, variable, index: int, indices: tf.Tensor) -> None:
        """Rows (and slots) of `indices` that the table gave to new ids start afresh.

        Then, after those writes, the table marks them written (`DynamicTable.mark_written`,
        which reads this copy's row stamps inside its lock).
        """
        stamps = owner.table.stamps(indices)
        stale = tf.not_equal(stamps, _gather(owner.row_stamps, indices))
        slots = tf.boolean_mask(indices, stale)
        writes = [_put(variable, slots, owner.initial_rows(slots))]
        for slot, initial in self._slots_of(index):
            shape = tf.concat([tf.shape(slots), slot.shape[1:]], 0)  # not reading `slot`
            writes.append(_put(slot, slots, tf.fill(shape, tf.cast(initial, slot.dtype))))
        writes.append(_put(owner.row_stamps, slots, tf.boolean_mask(stamps, stale)))
        copy = _handle(owner.row_stamps)  # read here: the marking is traced apart
        with tf.control_dependencies(writes):
            owner.table.mark_written(
                slots,
                lambda at: tf.raw_ops.ResourceGather(resource=copy, indices=at, dtype=tf.int64),
            )

    def _slots_of(self, index: int) -> list[tuple]:
        """`(slot variable, initial value)` of each slot of the variable at `index`."""
        raise NotImplementedError

    def _update_rows(self, grad, indices, variable, index, learning_rate) -> None:
        """Applies `grad` (one row per index, no index twice) to rows `indices` and their slots."""
        raise NotImplementedError


class _FusedAdamUpdate:
    """Keras's Adam update of one variable, as one `ResourceApplyAdam` kernel.

    Mixed into Keras's Adam and AdamW (whose decoupled weight decay Keras applies
    before this update).
    """

    def update_step(self, gradient, variable, learning_rate):
        if self.amsgrad or not _dense(gradient):
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        step = self._next_step(dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        index = tf_private.variable_index(self, variable)
        tf.raw_ops.ResourceApplyAdam(
            var=_handle(variable),
            m=_handle(tf_private.slots(self, "momentums")[index]),
            v=_handle(tf_private.slots(self, "velocities")[index]),
            beta1_power=tf.pow(beta_1, step),
            beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(learning_rate, dtype),
            beta1=beta_1,
            beta2=beta_2,
            epsilon=tf.cast(self.epsilon, dtype),
            grad=tf.cast(gradient, dtype),
        )


class _SummedByCaller:
    """Keras's cross-replica sum of the gradients, which `summed_by_caller` turns off.

    Mixed into every optimizer here. Keras 3's TensorFlow optimizer all-reduces
    whatever it is given, in the gradients' dtype and without packing, and has
    no public switch (tf.keras had `skip_gradients_aggregation`); a train step
    that sums in bfloat16 or in packs (`strategies.transfer`) would otherwise
    have its sum summed again.
    """

    _summed_by_caller = False

    def sum_gradients(self, grads_and_vars):
        replica = tf.distribute.get_replica_context()
        if self._summed_by_caller or (replica and replica.num_replicas_in_sync == 1):
            return list(grads_and_vars)
        return super().sum_gradients(grads_and_vars)


@contextlib.contextmanager
def summed_by_caller(optimizer: keras.optimizers.Optimizer) -> Iterator[None]:
    """Inside, `optimizer` applies gradients as given: the caller summed them over replicas.

    Works while the update is traced (inside a `tf.function`, as the train step is).

    Raises:
      TypeError: `optimizer` (or the one a loss-scale optimizer wraps) is not one
        of this module's, or this Keras no longer sums through the method it overrides.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # under loss scaling
    if not isinstance(inner, _SummedByCaller):
        raise TypeError(
            f"{type(inner).__name__} always all-reduces its gradients; build the optimizer "
            "with `trainer.loop.optim.build`."
        )
    if not tf_private.OptimizerHooks.sums_gradients():
        raise TypeError(
            f"Keras {keras.__version__} no longer sums gradients where towerflow can turn "
            "it off to sum them itself; set `gradient_dtype` to float32 and `bytes_per_pack` to 0."
        )
    tf_patches.targeted("sum_gradients_in_caller")
    inner._summed_by_caller = True
    try:
        yield
    finally:
        inner._summed_by_caller = False


class _LazyAdamRows:
    """Adam on some rows: their moments and values change, the others' stay."""

    def _slots_of(self, index: int) -> list[tuple]:
        slots = [
            (tf_private.slots(self, "momentums")[index], 0.0),
            (tf_private.slots(self, "velocities")[index], 0.0),
        ]
        return slots + (
            [(tf_private.slots(self, "velocity_hats")[index], 0.0)] if self.amsgrad else []
        )

    def _update_rows(self, grad, indices, variable, index, learning_rate):
        dtype = variable.dtype
        step = self._next_step(dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        alpha = learning_rate * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
        m, v = (
            tf_private.slots(self, "momentums")[index],
            tf_private.slots(self, "velocities")[index],
        )
        m_rows = _gather(m, indices)
        v_rows = _gather(v, indices)
        m_rows += (grad - m_rows) * (1 - beta_1)
        v_rows += (tf.square(grad) - v_rows) * (1 - beta_2)
        _put(m, indices, m_rows)
        _put(v, indices, v_rows)
        if self.amsgrad:
            v_rows = tf.maximum(
                _gather(tf_private.slots(self, "velocity_hats")[index], indices), v_rows
            )
            _put(tf_private.slots(self, "velocity_hats")[index], indices, v_rows)
        step_rows = alpha * m_rows / (tf.sqrt(v_rows) + tf.cast(self.epsilon, dtype))
        _put(variable, indices, _gather(variable, indices) - step_rows)


class Adam(
    _LazyAdamRows,
    _SparseRows,
    _FusedAdamUpdate,
    _SummedByCaller,
    tf_private.OptimizerHooks,
    keras.optimizers.Adam,
):
    """Keras's Adam; each dense update is one fused kernel, sparse ones lazy."""


class _RowDecay:
    """Decoupled weight decay of the rows a sparse gradient names, not of the whole table.

    Keras decays every variable before its update, a table's every row
    included, each step; here a variable updated sparsely decays only in the
    rows looked up (as the rest of a lazy update), so a step touches only those.
    """

    _sparse_now: frozenset = frozenset()

    def apply(self, grads, trainable_variables=None):
        variables = (
            tf_private.built_variables(self) if trainable_variables is None else trainable_variables
        )
        sparse = [v for g, v in zip(grads, variables) if self._updates_rows(g, v)]
        self._sparse_now = frozenset(tf_private.variable_key(self, v) for v in sparse)
        try:
            return super().apply(grads, trainable_variables)
        finally:
            self._sparse_now = frozenset()

    def uses_weight_decay(self, variable):
        """Keras asks this of each variable before its decay: not here for a sparse one."""
        key = tf_private.variable_key(self, variable)
        return key not in self._sparse_now and self._decays(variable)

    def _decays(self, variable) -> bool:
        return super().uses_weight_decay(variable)

    def _updates_rows(self, gradient, variable) -> bool:
        """Whether `variable` is updated row by row (else densely, decay and all, as Keras)."""
        if not isinstance(gradient, tf.IndexedSlices):
            return False
        return self.sparse_updates or tables.owner_of(variable) is not None

    def update_step(self, gradient, variable, learning_rate):
        rows = tf_private.variable_key(self, variable) in self._sparse_now
        if self.weight_decay and rows and self._decays(variable):
            indices, _ = tf.unique(gradient.indices)
            rows = _gather(variable, indices)
            decay = tf.cast(self.weight_decay, variable.dtype)
            _put(variable, indices, rows - rows * decay * tf.cast(learning_rate, variable.dtype))
        return super().update_step(gradient, variable, learning_rate)


class AdamW(
    _RowDecay,
    _LazyAdamRows,
    _SparseRows,
    _FusedAdamUpdate,
    _SummedByCaller,
    tf_private.OptimizerHooks,
    keras.optimizers.AdamW,
):
    """Keras's AdamW; each dense update is one fused kernel, sparse ones lazy (decay too)."""


class Adagrad(_SparseRows, _SummedByCaller, tf_private.OptimizerHooks, keras.optimizers.Adagrad):
    """Keras's Adagrad; a sparse update changes only the rows looked up."""

    def _slots_of(self, index: int) -> list[tuple]:
        return [(tf_private.slots(self, "accumulators")[index], self.initial_accumulator_value)]

    def _update_rows(self, grad, indices, variable, index, learning_rate):
        accumulator = tf_private.slots(self, "accumulators")[index]
        rows = _gather(accumulator, indices) + tf.square(grad)
        _put(accumulator, indices, rows)
        step_rows = learning_rate * grad / tf.sqrt(rows + tf.cast(self.epsilon, rows.dtype))
        _put(variable, indices, _gather(variable, indices) - step_rows)


class Ftrl(_SparseRows, _SummedByCaller, tf_private.OptimizerHooks, keras.optimizers.Ftrl):
    """Keras's FTRL-Proximal; a sparse update changes only the rows looked up."""

    def _slots_of(self, index: int) -> list[tuple]:
        return [
            (tf_private.slots(self, "accumulators")[index], self.initial_accumulator_value),
            (tf_private.slots(self, "linears")[index], 0.0),
        ]

    def _update_rows(self, grad, indices, variable, index, learning_rate):
        # Keras's `Ftrl.update_step`, on the rows `indices`.
        accumulator, linear = (
            tf_private.slots(self, "accumulators")[index],
            tf_private.slots(self, "linears")[index],
        )
        rows = _gather(variable, indices)
        accum = _gather(accumulator, indices)
        power = -self.learning_rate_power
        l2 = self.l2_regularization_strength + self.beta / (2.0 * learning_rate)
        shrunk = grad + 2 * self.l2_shrinkage_regularization_strength * rows
        new_accum = accum + tf.square(grad)
        new_linear = (
            _gather(linear, indices)
            + shrunk
            - ((tf.pow(new_accum, power) - tf.pow(accum, power)) / learning_rate * rows)
        )
        quadratic = tf.pow(new_accum, power) / learning_rate + 2 * l2
        l1 = self.l1_regularization_strength
        clipped = tf.clip_by_value(new_linear, -l1, l1)
        _put(linear, indices, new_linear)
        _put(accumulator, indices, new_accum)
        _put(variable, indices, (clipped - new_linear) / quadratic)


class SGD(_SparseRows, _SummedByCaller, tf_private.OptimizerHooks, keras.optimizers.SGD):
    """Keras's SGD; with momentum (not Nesterov), each dense update is one fused kernel.

    A sparse update changes only the rows looked up (and their momentum).
    """

    def _slots_of(self, index: int) -> list[tuple]:
        return [(self.momentums[index], 0.0)] if self.momentum else []

    def _update_rows(self, grad, indices, variable, index, learning_rate):
        step_rows = -learning_rate * grad
        if self.momentum:
            m = self.momentums[index]
            m_rows = step_rows + tf.cast(self.momentum, grad.dtype) * _gather(m, indices)
            _put(m, indices, m_rows)
            nesterov = step_rows + tf.cast(self.momentum, grad.dtype) * m_rows
            step_rows = nesterov if self.nesterov else m_rows
        _put(variable, indices, _gather(variable, indices) + step_rows)

    def update_step(self, gradient, variable, learning_rate):
        if not self.momentum or self.nesterov or not _dense(gradient):
            return super().update_step(gradient, variable, learning_rate)
        dtype = variable.dtype
        tf.raw_ops.ResourceApplyKerasMomentum(
            var=_handle(variable),
            accum=_handle(self.momentums[tf_private.variable_index(self, variable)]),
            lr=tf.cast(learning_rate, dtype),
            grad=tf.cast(gradient, dtype),
            momentum=tf.cast(self.momentum, dtype),
        )


def slots_of(optimizer: keras.optimizers.Optimizer, variable) -> list[tuple]:
    """`(slot variable, initial value)` of each slot `optimizer` keeps for `variable`.

    No slots for a variable that is not trainable. `optimizer` (or the one a
    loss-scale optimizer wraps) is one of this module's, built for `variable`;
    a table's own optimizer keeps the slots of its rows.
    """
    if not variable.trainable:
        return []
    inner = getattr(optimizer, "inner_optimizer", optimizer).trainer_of(variable)
    return inner._slots_of(tf_private.variable_index(inner, variable))


def own_variables(optimizer: keras.optimizers.Optimizer) -> list:
    """The variables of `optimizer` that are no variable's slot (its step, a loss scale, ...).

    Those of the tables' own optimizers follow, in the order they were built.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    slots = {id(slot) for variable in inner._built_on for slot, _ in slots_of(inner, variable)}
    tables_own = list({id(t): t for t in inner._table_optimizers.values()}.values())
    everything = [v for o in [optimizer, *tables_own] for v in o.variables]
    return [v for v in everything if id(v) not in slots]


def like(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """A new optimizer of the kind and options of `optimizer`, not built."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        config = optimizer.get_config()
        return keras.optimizers.LossScaleOptimizer(
            like(optimizer.inner_optimizer),
            initial_scale=config["initial_scale"],
            dynamic_growth_steps=config["dynamic_growth_steps"],
        )
    config = optimizer.get_config()
    rate = tf_private.learning_rate_of(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        config["learning_rate"] = rate  # `get_config` gives its config, which Keras cannot rebuild
    new = type(optimizer).from_config(config)
    if isinstance(optimizer, _SparseRows):
        new.sparse_updates, new.options = optimizer.sparse_updates, optimizer.options
    return new


def _by_name(sgd: type, adam: type, adamw: type, adagrad: type, ftrl: type) -> dict:
    return {
        "sgd": lambda rate, c: sgd(rate),
        "momentum": lambda rate, c: sgd(rate, momentum=c.momentum),
        "adam": lambda rate, c: adam(rate),
        "adamw": lambda rate, c: adamw(rate, weight_decay=c.weight_decay),
        "adagrad": lambda rate, c: adagrad(rate),
        "ftrl": lambda rate, c: ftrl(rate),
    }


OPTIMIZERS = _by_name(SGD, Adam, AdamW, Adagrad, Ftrl)
# A table's own "momentum" or "adamw" outside the trainer (no `optimizer` config): these.
_TABLE_DEFAULTS = ml_collections.ConfigDict({"momentum": 0.9, "weight_decay": 1e-4})
# Keras's own classes, for comparisons (`python -m trainer.bench`).
KERAS_OPTIMIZERS = _by_name(
    *(getattr(keras.optimizers, k.__name__) for k in (SGD, Adam, AdamW, Adagrad, Ftrl))
)
SCHEDULES = ("constant", "cosine", "step")


class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak`, then constant, cosine decay to 0, or step drops."""

    def __init__(
        self,
        peak: float,
        kind: str,
        total_steps: int,
        warmup_steps: int = 0,
        boundaries: tuple[int, ...] = (),
        decay_rate: float = 0.1,
    ):
        self.peak = peak
        self.kind = kind
        self.total_steps = total_steps
        self.warmup_steps = warmup_steps
        self.boundaries = tuple(boundaries)
        self.decay_rate = decay_rate
        # One function call, not a dozen eager ops, when the loop reads the rate each loop.
        self._rate = tf.function(self._rate_at, autograph=False)  # its `if`s are Python's

    def __call__(self, step):
        return self._rate(tf.convert_to_tensor(step))

    def _rate_at(self, step):
        step = tf.cast(step, tf.float32)
        if self.kind == "cosine":
            span = max(self.total_steps - self.warmup_steps, 1)
            progress = tf.clip_by_value((step - self.warmup_steps) / span, 0.0, 1.0)
            rate = 0.5 * self.peak * (1.0 + tf.cos(math.pi * progress))
        elif self.kind == "step":
            drops = tf.add_n([tf.cast(step >= b, tf.float32) for b in self.boundaries] + [0.0])
            rate = self.peak * tf.pow(self.decay_rate, drops)
        else:
            rate = tf.constant(self.peak, tf.float32)
        if self.warmup_steps:
            rate = tf.minimum(rate, self.peak * (step + 1.0) / self.warmup_steps)
        return rate

    def get_config(self) -> dict:
        return {
            "peak": self.peak,
            "kind": self.kind,
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "boundaries": self.boundaries,
            "decay_rate": self.decay_rate,
        }


def check(config: ml_collections.ConfigDict) -> None:
    """Checks the `optimizer` section: its name, schedule, rate, warm-up and drops.

    Raises:
      UserError: an unknown optimizer or schedule name, or a bad rate, warm-up or
        `decay_steps`.
    """
    if config.name not in OPTIMIZERS:
        raise UserError(
            f"Unknown `optimizer.name` '{config.name}'; known: {', '.join(OPTIMIZERS)}."
        )
    if config.schedule not in SCHEDULES:
        raise UserError(
            f"Unknown `optimizer.schedule` '{config.schedule}'; known: {', '.join(SCHEDULES)}."
        )
    if config.learning_rate <= 0:
        raise UserError(f"`optimizer.learning_rate` ({config.learning_rate}) must be positive.")
    if config.warmup_steps < 0:
        raise UserError(f"`optimizer.warmup_steps` ({config.warmup_steps}) must be >= 0.")
    _check_boundaries(tuple(config.decay_steps))


def _check_boundaries(steps: tuple) -> None:
    """The step schedule's drops: positive whole steps, each after the one before."""
    whole = all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in steps)
    if not whole or any(s <= 0 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:])):
        raise UserError(
            f"`optimizer.decay_steps` ({steps}) must be positive steps in increasing order "
            "(where the step schedule drops the rate); e.g. "
            "`--config.optimizer.decay_steps='(1000, 2000)'`."
        )


def schedule(config: ml_collections.ConfigDict, total_steps: int) -> WarmupSchedule:
    """The learning-rate schedule of `config` (the `optimizer` section, as `check` allows)."""
    return WarmupSchedule(
        config.learning_rate,
        config.schedule,
        total_steps,
        config.warmup_steps,
        tuple(config.decay_steps),
        config.decay_rate,
    )


def build(
    config: ml_collections.ConfigDict, total_steps: int, fused: bool = True
) -> keras.optimizers.Optimizer:
    """A Keras optimizer named by `config.name` with its schedule.

    With `fused=False`, Keras's own class (one op per elementwise step of the update).

    Gradient clipping is not set here: the train step clips the gradient summed
    over all replicas (Keras would clip each replica's part separately).

    Raises:
      UserError: an unknown optimizer or schedule name, or a bad rate (`check`).
    """
    check(config)
    kinds = OPTIMIZERS if fused else KERAS_OPTIMIZERS
    optimizer = kinds[config.name](schedule(config, total_steps), config)
    if fused:
        optimizer.sparse_updates = bool(config.get("sparse_updates", True))
        optimizer.options = config
    return optimizer
