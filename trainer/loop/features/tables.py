"""Dynamic tables (`trainer.layers`): their options declared, figures each block, lines, results.

The ctr model's table options (`model.embedding`, `model.capacity`, ...) are declared in
`trainer.loop.options.TableOptions` and checked at start-up from there.
"""

from __future__ import annotations

from trainer import layers
from trainer.loop import actions, component, options


@component.register("tables")
class Tables(component.Component):
    """Each dynamic table's ids, admissions, evictions, default-row share and bytes, per block."""

    # `model.embedding`, `model.capacity`, ...: the ctr model's table (configs/ctr.py).
    section = options.TABLES

    def build(self, context: component.Context) -> component.Feature | None:
        if not layers.dynamic_tables(context.model):
            return None
        return _Figures(context.model)


class _Figures(component.Feature):
    slot = component.Slot.METRICS

    def __init__(self, model):
        self._model = model

    def lines(self) -> list[str]:
        return [table["line"] for table in layers.describe_tables(self._model).values()]

    def actions(self, run: component.Run) -> list[actions.Action]:
        return [actions.tables(lambda: layers.table_figures(self._model))]

    def results(self) -> dict:
        described = layers.describe_tables(self._model)
        # Each dynamic table's policy, where its parts are, the ids they hold.
        return {
            "tables": {
                name: {k: v for k, v in t.items() if k != "line"} for name, t in described.items()
            }
        }
