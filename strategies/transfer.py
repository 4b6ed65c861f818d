"""How gradients cross replicas: their dtype on the wire, and how they are packed.

Two options of the synchronous plugins that all-reduce (`mirrored`,
`central_storage`, `multi_worker`), under `config.strategy.<name>`:

- `gradient_dtype`: "float32" (the default) or "bfloat16". bfloat16 halves
  the bytes every step sends: each replica's gradients are cast before the
  cross-replica sum and back after, so the sum itself runs in bfloat16 (8
  bits of mantissa: about 3 significant digits), while the update, the
  optimizer's state and loss scaling stay float32.
- `bytes_per_pack` (`multi_worker`): "0" (all gradients concatenated into one
  collective, TensorFlow's default), "auto" (packs of about 16 MB, whose
  collectives overlap: the 59 MB of gradients of the benchmark's
  `dense_large` MLP all-reduce 1.2-1.3x faster between two processes here)
  or a number of bytes. A pack holds whole tensors: one tensor is never split.

With either set, the train step sums the gradients itself
(`GradientTransfer.all_reduce`) and the optimizer applies the sum without
its own all-reduce. TensorFlow's replica-context all-reduce, which Keras's
optimizer uses, packs only as the call's own options say, so packing set on
the strategy alone would not reach the gradients. With neither, the step is
as it always was: Keras's optimizer all-reduces float32 gradients.
"""

from __future__ import annotations

import dataclasses

import ml_collections
import tensorflow as tf

from towerflow.errors import UserError

GRADIENT_DTYPES = {"float32": tf.float32, "bfloat16": tf.bfloat16}
AUTO_BYTES_PER_PACK = 16 << 20  # what "auto" packs


@dataclasses.dataclass(frozen=True)
class GradientTransfer:
    """The dtype gradients are summed in across replicas, and the size of their packs."""

    dtype: str = "float32"
    bytes_per_pack: int = 0  # 0: one pack of every gradient

    @property
    def summed_by_step(self) -> bool:
        """Whether the train step sums the gradients itself (else Keras's optimizer does)."""
        return self.dtype != "float32" or self.bytes_per_pack > 0

    def all_reduce(self, gradients: list) -> list:
        """This replica's `gradients` summed over all replicas; call in replica context.

        Each gradient crosses in `dtype` and comes back in its own; None stays None.
        """
        present = [g for g in gradients if g is not None]
        wire = GRADIENT_DTYPES[self.dtype]
        summed = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM,
            [tf.cast(g, wire) for g in present],
            options=tf.distribute.experimental.CommunicationOptions(
                bytes_per_pack=self.bytes_per_pack
            ),
        )
        back = iter([tf.cast(s, g.dtype) for s, g in zip(summed, present)])
        return [None if g is None else next(back) for g in gradients]

    def describe(self) -> str:
        """How gradients cross, e.g. "in bfloat16, 16 MB packs"; "" for the default."""
        parts = [f"in {self.dtype}"] if self.dtype != "float32" else []
        if self.bytes_per_pack:
            parts.append(f"{self.bytes_per_pack / 2**20:g} MB packs")
        return ", ".join(parts)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def from_options(options: ml_collections.ConfigDict, name: str) -> GradientTransfer:
    """The transfer the `config.strategy.<name>` options ask for.

    `options` are the plugin's own (`strategies.base.read_options`), with its
    declared defaults: `gradient_dtype`, and `bytes_per_pack` where the plugin
    packs (a plugin that declares no packing all-reduces in one pack).

    Raises:
      UserError: an unknown `gradient_dtype`, or a `bytes_per_pack` that is not
        "auto" or a number of bytes >= 0.
    """
    dtype = options.gradient_dtype
    if dtype not in GRADIENT_DTYPES:
        raise UserError(
            f"Unknown `strategy.{name}.gradient_dtype` '{dtype}'; known: "
            f"{', '.join(GRADIENT_DTYPES)}; e.g. "
            f"`--config.strategy.{name}.gradient_dtype=bfloat16`."
        )
    if "bytes_per_pack" not in options:
        return GradientTransfer(dtype)
    return GradientTransfer(dtype, _bytes_per_pack(options.bytes_per_pack, name))


def _bytes_per_pack(value, name: str) -> int:
    text = str(value).strip().lower()
    if text == "auto":
        return AUTO_BYTES_PER_PACK
    if text.isdigit():
        return int(text)
    raise UserError(
        f"`strategy.{name}.bytes_per_pack` ({value!r}) must be 'auto' (about "
        f"{AUTO_BYTES_PER_PACK >> 20} MB packs), 0 (one pack) or a number of bytes; "
        f"e.g. `--config.strategy.{name}.bytes_per_pack=auto`."
    )


def refuse(options: ml_collections.ConfigDict, name: str) -> None:
    """Refuses a `gradient_dtype` other than float32 under a plugin `name` that does not all-reduce.

    `options` are the plugin's own (`strategies.base.read_options`); one that
    declares no `gradient_dtype` has nothing to refuse. Every plugin without
    `Traits.gradient_transfer` calls it as it is made (`Strategy.__init__`).

    Raises:
      UserError: `config.strategy.<name>.gradient_dtype` is set to another dtype.
    """
    if "gradient_dtype" not in options or options.gradient_dtype == "float32":
        return
    dtype = options.gradient_dtype
    raise UserError(
        f"`strategy.{name}.gradient_dtype` '{dtype}' does not apply to `{name}`: its "
        "gradients are not all-reduced across replicas; use `--strategy=multi_worker`, "
        f"`mirrored` or `central_storage` for {dtype} transfer, or leave "
        f"`strategy.{name}.gradient_dtype` float32."
    )
