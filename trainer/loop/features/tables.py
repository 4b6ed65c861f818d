"""Dynamic tables (`trainer.layers`): their options checked, figures each block, lines, results."""

from __future__ import annotations

import ml_collections

from towerflow.errors import UserError
from trainer import layers
from trainer.layers import tables
from trainer.loop import actions, component


@component.register("tables")
class Tables(component.Component):
    """Each dynamic table's ids, admissions, evictions, default-row share and bytes, per block."""

    fields = (
        "model.eviction",
        "model.fallback_rows",
        "model.fallback_hashes",
        "model.fallback_combiner",
        "model.sketch_width",
        "model.sketch_depth",
        "model.seen_bits",
    )

    def check(self, config, traits) -> None:
        _check_dynamic_table(config.model)

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


def _check_dynamic_table(model: ml_collections.ConfigDict) -> None:
    """The dynamic table's options of the built-in ctr model (`model.embedding=dynamic`)."""
    if model.get("embedding") != "dynamic":
        return
    eviction = model.get("eviction", "lfu")
    if eviction not in ("lfu", "lru", ""):
        raise UserError(
            f"`model.eviction` '{eviction}' is not an eviction policy; use one of lfu, lru "
            "or '' (none: a full table refuses new ids), e.g. `--config.model.eviction=lfu`."
        )
    fallback = model.get("fallback_rows", 0)
    if fallback < 0:
        raise UserError(
            f"`model.fallback_rows` ({fallback}) must be >= 0 (hashed rows for ids without "
            "a row; 0: one shared default row); set e.g. `--config.model.fallback_rows=1000`."
        )
    hashes = model.get("fallback_hashes", 2)
    if hashes < 1:
        raise UserError(
            f"`model.fallback_hashes` ({hashes}) must be >= 1 (the fallback rows an id without "
            "a row reads); set e.g. `--config.model.fallback_hashes=2`."
        )
    combiner = model.get("fallback_combiner", tables.FALLBACK_COMBINER)
    if combiner not in tables.FALLBACK_COMBINERS:
        raise UserError(
            f"`model.fallback_combiner` '{combiner}' is not a way to combine fallback rows; use "
            f"{' or '.join(tables.FALLBACK_COMBINERS)}, e.g. "
            f"`--config.model.fallback_combiner={tables.FALLBACK_COMBINER}`."
        )
    for field, example in (("sketch_width", 8192), ("sketch_depth", 2)):
        value = model.get(field, example)
        if value < 1:
            raise UserError(
                f"`model.{field}` ({value}) must be >= 1 (the count-min sketch of ids not "
                f"admitted yet); set e.g. `--config.model.{field}={example}`."
            )
    seen = model.get("seen_bits", tables.SEEN_BITS)
    if seen < 0:
        raise UserError(
            f"`model.seen_bits` ({seen}) must be >= 0 (the bits of each generation of the "
            "table's seen-filter; 0: none); set e.g. "
            f"`--config.model.seen_bits={tables.SEEN_BITS}`."
        )
