"""How a dynamic table's rows are trained: by a row-aware optimizer, maybe the table's own.

A `DynamicEmbedding` reuses a row for a new id when it evicts an old one,
and reads a new id's initial value until the row is written: the optimizer
that updates the rows must reset a row and its slots where the table gave
it to a new id (`trainer.loop.optim`'s optimizers do). A Keras optimizer's
own class cannot: it would write rows the lookups never read (the table
never learns, silently). So the rows carry a constraint that refuses: every
Keras optimizer applies a variable's constraint right after updating it, at
the first step, and the row-aware optimizers take the rows off that path
(`constraints_lifted`).

A table may also name its own optimizer and learning rate
(`TableOptimizer`, from `TableConfig(optimizer=..., learning_rate=...)` or
the ctr model's `model.table_optimizer`; a `DynamicEmbedding`'s
`table_optimizer`), e.g. Adagrad or FTRL for the tables and Adam for the
dense layers; the model's optimizer then hands the table's rows to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator

import keras

from strategies import tf_patches
from towerflow.errors import UserError

# The optimizers a table may name (`trainer.loop.optim.OPTIMIZERS`, the same names).
OPTIMIZER_NAMES = ("sgd", "momentum", "adam", "adamw", "adagrad", "ftrl")
ROW_AWARE = "`trainer.loop.optim.Adam` (or `SGD`, `AdamW`, `Adagrad`, `Ftrl`)"


@dataclasses.dataclass(frozen=True)
class TableOptimizer:
    """The optimizer of one table's rows, where it is not the model's.

    Attributes:
      name: one of `OPTIMIZER_NAMES`; None: the model's optimizer's kind.
      learning_rate: the table's peak learning rate (the model's schedule,
        scaled to it); None: the model's.
    """

    name: str | None = None
    learning_rate: float | None = None

    def check(self, where: str, fields: tuple[str, str] = ("optimizer", "learning_rate")) -> None:
        """Raises `UserError` naming the bad field (`fields`) of table `where` (may be "")."""
        name, rate = (f"{where} `{field}`".strip() for field in fields)
        if self.name is not None and self.name not in OPTIMIZER_NAMES:
            raise UserError(
                f"{name} '{self.name}' must be one of {', '.join(OPTIMIZER_NAMES)}, or unset "
                "for the model's optimizer."
            )
        if self.learning_rate is not None and not self.learning_rate > 0:
            raise UserError(
                f"{rate} ({self.learning_rate}) must be positive, or unset for the model's "
                "learning rate."
            )

    @property
    def is_own(self) -> bool:
        """Whether it differs from the model's optimizer at all."""
        return self.name is not None or self.learning_rate is not None


class RowAwareOnly(keras.constraints.Constraint):
    """The rows' constraint: refuses the optimizer that applies it (one that is not row-aware).

    Keras applies a variable's constraint after each update by the
    optimizer's own class; `trainer.loop.optim`'s optimizers lift it
    (`constraints_lifted`) and never call it.
    """

    def __init__(self, table: str):
        self.table = table

    def __call__(self, w):
        raise tf_patches.raised_through_autograph(
            UserError(
                f"`DynamicEmbedding` '{self.table}' is trained by an optimizer that does not "
                "reset the rows the table gives to new ids (a Keras optimizer's own class: the "
                f"table would never learn); use {ROW_AWARE}: Keras's classes with Keras's "
                "arguments, row-aware."
            )
        )

    def get_config(self) -> dict:
        return {"table": self.table}


@contextlib.contextmanager
def constraints_lifted(variables: Iterable) -> Iterator[None]:
    """Inside, the `RowAwareOnly` constraints of `variables` are off (a row-aware update)."""
    lifted = [v for v in variables if isinstance(getattr(v, "constraint", None), RowAwareOnly)]
    constraints = [v.constraint for v in lifted]
    for variable in lifted:
        variable.constraint = None
    try:
        yield
    finally:
        for variable, constraint in zip(lifted, constraints, strict=True):
            variable.constraint = constraint
