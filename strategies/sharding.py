"""The active sharding policy: how many shards a big variable is split into.

`tf.distribute.ParameterServerStrategy` can shard variables itself (its
`variable_partitioner`), but a Keras 3 variable cannot wrap the resulting
`ShardedVariable`. So towerflow shards in the layer instead: a sharded layer
(`trainer.layers.ShardedEmbedding`, `ShardedDense`) asks `num_shards(shape,
dtype)` how many pieces its big variable should have, and creates each piece
as its own plain variable along axis 0. The strategy places those plain
variables round-robin over the ps members, so consecutive shards land on
different ps members::

    with sharding.policy("fixed", num_shards=2):
        layer = ShardedEmbedding(200_000, 32)  # 2 variables of 100,000 rows

The `parameter_server` plugin enters the policy of its config in `scope()`;
everywhere else `num_shards` is 1 and a sharded layer is an ordinary one.
The policy also says where the parts of a dynamic table go
(`part_devices()`): one per ps member, placed on it by the coordinator of
`parameter_server` (`on_ps`), else all on the strategy's own devices. A
layer takes its parts from the policy, never from the strategy's type.
The counts follow `tf.distribute.experimental.partitioners`:

- "none": 1 (whole variables, placed round-robin);
- "fixed": `num_shards`, at most one row per shard;
- "min_size": as many shards as keep each at least `min_shard_bytes`, at most
  one per ps member;
- "max_size": as few shards as keep each at most `max_shard_bytes`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import tensorflow as tf

from strategies import tf_patches
from strategies.options import DEFAULT_MIN_SHARD_BYTES
from towerflow.errors import UserError

PARTITIONERS = ("none", "fixed", "min_size", "max_size")
# partitioner -> (the size option it needs, an example value)
_SIZE_FIELDS = {
    "fixed": ("num_shards", 2),
    "min_size": ("min_shard_bytes", DEFAULT_MIN_SHARD_BYTES),
    "max_size": ("max_shard_bytes", 1 << 20),
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """How big variables are split along axis 0.

    Attributes:
      partitioner: one of `PARTITIONERS`.
      num_shards: "fixed": shards per variable.
      min_shard_bytes: "min_size": the smallest shard, in bytes.
      max_shard_bytes: "max_size": the largest shard, in bytes.
      num_ps: the ps members the shards are spread over; caps "min_size". A
        dynamic table has one part per ps member.
      on_ps: whether a dynamic table's parts are placed on the ps members'
        devices (`/job:ps/task:N`; the coordinator of `parameter_server`),
        or all stay on the strategy's own devices (every other process).
    """

    partitioner: str = "none"
    num_shards: int = 1
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES
    max_shard_bytes: int = 0
    num_ps: int = 1
    on_ps: bool = False

    def __post_init__(self):
        if self.partitioner not in PARTITIONERS:
            raise UserError(
                f"Unknown `strategy.parameter_server.partitioner` '{self.partitioner}'; "
                f"known: {', '.join(PARTITIONERS)}."
            )
        name, example = _SIZE_FIELDS.get(self.partitioner, (None, None))
        if name and getattr(self, name) < 1:
            raise UserError(
                f"`strategy.parameter_server.{name}` ({getattr(self, name)}) must be >= 1 "
                f"with partitioner '{self.partitioner}'; set e.g. "
                f"`--config.strategy.parameter_server.{name}={example}`."
            )
        if self.num_ps < 1:
            raise ValueError(f"`num_ps` ({self.num_ps}) must be >= 1.")

    def num_shards_for(self, shape: Sequence[int], dtype: tf.DType | str) -> int:
        """How many shards along axis 0 a variable of `shape` and `dtype` gets."""
        shape = tf.TensorShape(shape)
        if self.partitioner == "none" or shape.rank == 0 or not shape[0]:
            return 1
        dtype = tf.as_dtype(dtype)
        if self.partitioner == "fixed":
            partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner(
                self.num_shards
            )
        elif self.partitioner == "min_size":
            partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
                self.min_shard_bytes, max_shards=self.num_ps
            )
        else:
            partitioner = tf.distribute.experimental.partitioners.MaxSizePartitioner(
                self.max_shard_bytes
            )
        return max(1, int(partitioner(shape, dtype)[0]))

    def part_devices(self) -> list[str | None]:
        """The device of each part of a dynamic table: a part per ps member.

        On the ps members' CPUs with `on_ps`; otherwise None for each (the
        strategy's own devices).
        """
        if not self.on_ps:
            return [None] * self.num_ps
        return [f"/job:ps/task:{member}/device:CPU:0" for member in range(self.num_ps)]

    def with_parts(self, parts: int) -> Policy:
        """This policy with whole variables and `parts` ps members, placed as this one.

        A layer's twin of another split (`trainer.layers.portable.Portable.twin`).
        """
        return dataclasses.replace(self, partitioner="none", num_ps=parts)


_ACTIVE: contextvars.ContextVar[Policy | None] = contextvars.ContextVar("sharding", default=None)


@contextlib.contextmanager
def policy(partitioner: str | Policy = "none", **options) -> Iterator[Policy]:
    """Makes a sharding policy the active one inside the block.

    Args:
      partitioner: one of `PARTITIONERS`, or a ready `Policy`.
      **options: the other `Policy` fields (num_shards, min_shard_bytes,
        max_shard_bytes, num_ps, on_ps).

    Raises:
      UserError: an unknown partitioner or a size below 1.
    """
    active = partitioner if isinstance(partitioner, Policy) else Policy(partitioner, **options)
    token = _ACTIVE.set(active)
    try:
        yield active
    finally:
        _ACTIVE.reset(token)


def current() -> Policy | None:
    """The active policy, or None outside a `policy` block.

    Under a bare `tf.distribute.experimental.ParameterServerStrategy` scope
    (TensorFlow's own, no towerflow plugin, no `policy` block), the policy that
    strategy implies: whole variables, a table's parts on each of its ps members.
    """
    active = _ACTIVE.get()
    return active if active is not None else _of_bare_parameter_server()


def _of_bare_parameter_server() -> Policy | None:
    """The policy a bare `ParameterServerStrategy` implies; None under any other strategy.

    The one place outside the plugins that asks a strategy's type: a layer
    built in a user's own `ParameterServerStrategy` scope (or the benchmark's
    `tables` case) has no plugin to enter a policy for it. Its ps count is a
    private read (`tf_patches.ps_count`).
    """
    strategy = tf.distribute.get_strategy()
    if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return None
    return Policy(num_ps=tf_patches.ps_count(strategy), on_ps=True)


def num_shards(shape: Sequence[int], dtype: tf.DType | str = tf.float32) -> int:
    """How many shards along axis 0 the active policy gives a variable; 1 outside a policy."""
    active = _ACTIVE.get()
    return active.num_shards_for(shape, dtype) if active else 1


def split_rows(rows: int, shards: int) -> list[int]:
    """Rows per shard for `rows` rows in `shards` shards: contiguous, the first ones larger.

    The layout of TF's `ShardedVariable` and of `tf.nn.embedding_lookup`'s "div"
    strategy: 10 rows in 4 shards are [3, 3, 2, 2].
    """
    base, extra = divmod(rows, shards)
    return [base + (1 if i < extra else 0) for i in range(shards)]
