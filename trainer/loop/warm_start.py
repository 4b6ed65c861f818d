"""Warm start: a new run begins from another run's variables (`train.warm_start`).

`train.warm_start` names another run's `model_dir` (its newest checkpoint)
or one checkpoint in it (`.../checkpoints/ckpt-600`);
`train.warm_start_include` is a regular expression of the variable names to
load (e.g. `embedding` for the tables only). A model variable whose name
matches is loaded from the variable of the same name there; a dynamic
table's ids come with its rows (its index, part by part). The optimizer, the
step and everything else start fresh; so does a variable the other run does
not have, which the report line names.

Names come from `variables.json`, which every run writes beside its
`config.json` (`record`): each checkpoint variable's name and shape, and
each dynamic table part's layer and key dtype. It applies only when the
run's own `model_dir` has no checkpoint: a resume wins (`train.py` says so).
The same file tells how each table read its fallback rows (`fallback_hashes`,
`fallback_combiner`, and the `fallback_seed` salting their hashes) and the
salt of each `keras.layers.Hashing` layer: a warm start or a resume
(`check_resumed`) that would read trained fallback rows another number at a
time, combined another way or at other rows, or that would hash ids into
other rows of the table it loads, stops in one line.

A table or sharded layer (`trainer.layers.Portable`) split into another
number of parts there (2 ps members there, one process here, or the reverse)
loads through a `twin` split as there: the checkpoint's parts go into the
twin, and its logical content (every id's row, or the whole kernel) into
this model's layer (`import_logical`), as `trainer.loop.portable` restores.
"""

from __future__ import annotations

import dataclasses
import os
import re

import keras
import ml_collections
import numpy as np
import tensorflow as tf

from strategies import tf_patches
from towerflow import storage
from towerflow.errors import UserError
from trainer import layers
from trainer.data.base import listed

NAMES_FILE = "variables.json"


def record(model: keras.Model, variables: list, model_dir: str) -> None:
    """Writes `model_dir/variables.json`: the checkpoint's variables and table parts, in order."""
    names = [{"name": _name(v), "shape": list(v.shape)} for v in variables]
    tables = [
        {
            "layer": layer.name,
            "part": i,
            "key_dtype": layer.key_dtype,
            "fallback_hashes": layer.fallback_hashes,
            "fallback_seed": layer.seed,
            "fallback_combiner": layer.fallback_combiner,
        }
        for layer in layers.dynamic_tables(model)
        for i in range(layer.num_parts)
    ]
    hashing = {layer.name: _salt(layer) for layer in _hashing_layers(model)}
    storage.write_json(
        os.path.join(model_dir, NAMES_FILE),
        {"variables": names, "tables": tables, "hashing": hashing},
    )


def _hashing_layers(model: keras.Model) -> list[keras.layers.Hashing]:
    hashing = keras.layers.Hashing
    return [layer for layer in tf_patches.flat_layers(model) if isinstance(layer, hashing)]


def _salt(layer: keras.layers.Hashing) -> list[int] | None:
    """A `Hashing` layer's salt as JSON holds it (None: unsalted)."""
    return None if layer.salt is None else [int(v) for v in np.ravel(layer.salt)]


def _name(variable) -> str:
    return getattr(variable, "path", None) or variable.name


@dataclasses.dataclass
class Resplit:
    """A layer split into `parts` there (another count, or a dynamic table), and where."""

    layer: layers.Portable
    parts: int
    variables: list[str]  # checkpoint keys of its variables there, in order
    tables: list[int]  # positions of its table parts there

    @property
    def moved(self) -> bool:
        """Whether the parts there are another number than here."""
        return self.parts != self.layer.num_parts


@dataclasses.dataclass
class WarmStartPlan:
    """What a warm start loads: checkpoint keys into model variables, table parts by position."""

    checkpoint: str
    variables: list[tuple[str, object]]  # (checkpoint key, model variable)
    tables: dict[str, list[tuple[int, tf.Module]]]  # layer -> (position there, its part's index)
    fresh: list[str]  # model variables that start fresh (not matched, or left out)
    resplit: list[Resplit] = dataclasses.field(default_factory=list)

    @property
    def loaded(self) -> int:
        """How many of the model's variables load: by name, or through a twin."""
        return len(self.variables) + sum(len(r.variables) for r in self.resplit)

    def line(self) -> str:
        """The one-line report of what was loaded and what starts fresh."""
        alike = [*self.tables, *(r.layer.name for r in self.resplit if not r.moved)]
        tables = f", the ids of {', '.join(alike)}" if alike else ""
        moved = [r for r in self.resplit if r.moved]
        if moved:
            tables += ", " + ", ".join(
                f"{r.layer.name} from {r.parts} parts into {r.layer.num_parts}" for r in moved
            )
        fresh = "none fresh"
        if self.fresh:
            fresh = f"{len(self.fresh)} start fresh ({listed(self.fresh, 4)})"
        return (
            f"warm start from {self.checkpoint}: loaded {self.loaded} variables{tables}; "
            f"{fresh}; the optimizer and the step start fresh"
        )


def plan(
    config: ml_collections.ConfigDict, model: keras.Model, variables: list
) -> WarmStartPlan | None:
    """What `train.warm_start` loads into `model` (its checkpoint's `variables`); checks only.

    Raises:
      UserError: no checkpoint at the path, no `variables.json` beside it, a bad
        regular expression, a name that matches with another shape, a split
        layer that no split gives there, or a table of another key dtype.
    """
    source = config.train.get("warm_start", "")
    if not source:
        return None
    pattern = config.train.get("warm_start_include", "") or ".*"
    try:
        include = re.compile(pattern)
    except re.error as e:
        raise UserError(
            f"`train.warm_start_include` '{pattern}' is not a regular expression ({e}); "
            "give e.g. 'embedding' (the tables) or '.*' (everything)."
        ) from None
    checkpoint, recorded = _checkpoint_of(source)
    resplit = _resplit(source, recorded, model, include)
    moved = {id(v) for r in resplit for v in r.layer.variables}
    tables = _tables(source, recorded, model, include, {id(r.layer) for r in resplit})
    there = {v["name"]: (i, tuple(v["shape"])) for i, v in enumerate(recorded["variables"])}
    loaded, fresh = [], []
    for variable in variables:
        name = _name(variable)
        if id(variable) in moved:
            continue
        if not include.search(name) or name not in there:
            fresh.append(name)
            continue
        i, shape = there[name]
        if shape != tuple(variable.shape):
            raise UserError(
                f"`train.warm_start` '{source}': `{name}` is {shape} there and "
                f"{tuple(variable.shape)} here; leave it out with `train.warm_start_include`, "
                "or warm start from a run of this model."
            )
        loaded.append((f"variables/{i}/.ATTRIBUTES/VARIABLE_VALUE", variable))
    names = {_name(v) for _, v in loaded} | {_name(v) for r in resplit for v in r.layer.variables}
    where = f"`train.warm_start` '{source}'"
    _check_salts(
        where, "leave the table out with `train.warm_start_include`", recorded, model, names
    )
    return WarmStartPlan(checkpoint, loaded, tables, fresh, resplit)


def _checkpoint_of(source: str) -> tuple[str, dict]:
    """The checkpoint `source` names (a model_dir or a checkpoint) and its `variables.json`."""
    model_dir, checkpoint = source, tf.train.latest_checkpoint(os.path.join(source, "checkpoints"))
    if checkpoint is None and tf.io.gfile.exists(source + ".index"):
        model_dir, checkpoint = os.path.dirname(os.path.dirname(source)), source
    if checkpoint is None:
        raise UserError(
            f"`train.warm_start` '{source}' holds no checkpoint; give another run's "
            "`model_dir` (or one checkpoint in it, e.g. '.../checkpoints/ckpt-600')."
        )
    recorded = storage.read_json(os.path.join(model_dir, NAMES_FILE))
    if not recorded:
        raise UserError(
            f"`train.warm_start` '{source}' has no `{NAMES_FILE}` (the names of its variables, "
            "written by runs of this version); retrain it, or restore it as this run's own "
            "checkpoint in its `model_dir`."
        )
    return checkpoint, recorded


def _resplit(source: str, recorded: dict, model: keras.Model, include: re.Pattern) -> list[Resplit]:
    """Each included split layer split into another number of parts there, and each table.

    A layer's variables there are those named under its own prefix (`embedding/`);
    their shapes say how many parts held it (`Portable.split_shapes`). A
    dynamic table always loads through a twin, split alike or not: its index
    tracks the optimizer's step as its clock, so reading the checkpoint into
    this model's own index would bring that run's step with it.
    """
    found = []
    for layer in layers.portable_layers(model):
        if not include.search(layer.name):
            continue
        prefix = _name(layer.variables[0]).rsplit("/", 1)[0] + "/"
        mine = [
            (i, tuple(v["shape"]))
            for i, v in enumerate(recorded["variables"])
            if v["name"].startswith(prefix)
        ]
        shapes = [shape for _, shape in mine]
        parts = next(
            (n for n in range(1, len(mine) + 1) if _shapes(layer.split_shapes(n)) == shapes), None
        )
        if not mine or (parts == layer.num_parts and not layer.indexes()):
            continue  # not there, or split alike without an index: loaded by name
        if parts is None:
            raise UserError(
                f"`train.warm_start` '{source}': `{layer.name}` has variables of {shapes} there, "
                "which no split of this layer gives (another size); leave it out with "
                "`train.warm_start_include`, or warm start from a run of this model."
            )
        keys = [f"variables/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i, _ in mine]
        positions = [i for i, part in enumerate(recorded["tables"]) if part["layer"] == layer.name]
        found.append(Resplit(layer, parts, keys, positions))
    return found


def _shapes(shapes: list | None) -> list[tuple[int, ...]] | None:
    return None if shapes is None else [tuple(s) for s in shapes]


def _tables(
    source: str,
    recorded: dict,
    model: keras.Model,
    include: re.Pattern,
    resplit: set[int],
) -> dict[str, list[tuple[int, tf.Module]]]:
    """Each included dynamic table's parts: (position there, this model's part's index)."""
    there: dict[str, list[tuple[int, dict]]] = {}
    for position, part in enumerate(recorded["tables"]):
        there.setdefault(part["layer"], []).append((position, part))
    matched = {}
    for layer in layers.dynamic_tables(model):
        if not include.search(layer.name) or layer.name not in there:
            continue
        parts = there[layer.name]
        key_dtype = parts[0][1]["key_dtype"]
        if key_dtype != layer.key_dtype:
            raise UserError(
                f"`train.warm_start` '{source}': table `{layer.name}` has {key_dtype} keys there "
                f"and {layer.key_dtype} here; leave it out with `train.warm_start_include`."
            )
        where, afresh = (
            f"`train.warm_start` '{source}'",
            "leave it out with `train.warm_start_include`",
        )
        _check_fallback_kept(where, afresh, recorded, layer, parts[0][1])
        if id(layer) in resplit:
            continue  # loaded through a twin split as there (`_resplit`)
        pairs = zip(parts, layer.indexes(), strict=True)
        matched[layer.name] = [(position, index) for (position, _), index in pairs]
    return matched


def check_resumed(model: keras.Model, model_dir: str) -> None:
    """A run that resumes in `model_dir` reads its tables' fallback rows as they trained.

    From the `variables.json` of the run that wrote `model_dir`'s checkpoints
    (none, or no checkpoint: nothing to resume). A table part recorded without
    `fallback_hashes`, `fallback_combiner` or `fallback_seed` (written before
    they existed) read one row, summed, unsalted; a `Hashing` layer's salt is
    checked where recorded.

    Raises:
      UserError: a table here reads another number of fallback rows per id,
        combines them otherwise, or reads other rows; a `Hashing` layer here has
        another salt.
    """
    if tf.train.latest_checkpoint(os.path.join(model_dir, "checkpoints")) is None:
        return
    recorded = storage.read_json(os.path.join(model_dir, NAMES_FILE))
    if not recorded:
        return
    there = {part["layer"]: part for part in recorded["tables"]}
    where, afresh = f"`--model_dir` '{model_dir}'", "train into another `--model_dir`"
    for layer in layers.dynamic_tables(model):
        if layer.name in there:
            _check_fallback_kept(where, afresh, recorded, layer, there[layer.name])
    _check_salts(where, afresh, recorded, model)


def _check_salts(
    where: str, afresh: str, recorded: dict, model: keras.Model, loaded: set[str] | None = None
) -> None:
    """Each `Hashing` layer of `model` hashes ids as `where` (`recorded`) did, if it matters.

    It matters for a resume (`loaded` None), and for a warm start that loads a
    variable of the first layers with variables after the `Hashing` layer
    (`loaded`: the names loaded; in a model without a graph of layers, any).
    """
    salts = recorded.get("hashing", {})
    for layer in _hashing_layers(model):
        if layer.name not in salts or salts[layer.name] == _salt(layer):
            continue
        fed = _fed_variables(layer)
        if loaded is not None and not (loaded & fed if fed else loaded):
            continue
        raise UserError(
            f"{where}: layer `{layer.name}` hashed ids with salt {salts[layer.name]} there "
            f"and {_salt(layer)} here, which puts them in other rows; keep its salt "
            f"(configs/ctr.py: the `--config.model.table_seed` it trained with), or {afresh}."
        )


def _fed_variables(layer: keras.layers.Layer) -> set[str]:
    """The names of the variables of the first layers with any after `layer` in its model's graph.

    Empty where the model has no graph of layers (a subclassed model).
    """
    names, todo, seen = set(), tf_patches.layers_after(layer), set()
    while todo:
        after = todo.pop()
        if id(after) in seen:
            continue
        seen.add(id(after))
        if after.weights:
            names |= {_name(v) for v in after.weights}
        else:
            todo += tf_patches.layers_after(after)
    return names


def _check_fallback_kept(where: str, afresh: str, recorded: dict, layer, part: dict) -> None:
    """`layer`'s fallback rows, if `where` (`recorded`) holds them, read as they trained there.

    `part`: a part of the table as `variables.json` records it (without
    `fallback_hashes`: 1; without `fallback_combiner`: "sum"; without
    `fallback_seed`: 0, unsalted); `afresh`: how to start the table afresh
    instead, for the error. One row read per id is the same mean or sum.
    """
    hashes, seed = part.get("fallback_hashes", 1), part.get("fallback_seed", 0)
    combiner = part.get("fallback_combiner", "sum") if hashes > 1 else layer.fallback_combiner
    here = (layer.fallback_hashes, layer.fallback_combiner, layer.seed)
    if layer.fallback is None or (hashes, combiner, seed) == here:
        return
    if _name(layer.fallback) not in {v["name"] for v in recorded["variables"]}:
        return
    if hashes != layer.fallback_hashes:
        raise UserError(
            f"{where}: table `{layer.name}` read its fallback rows {hashes} per id there and "
            f"{layer.fallback_hashes} here; build it with `fallback_hashes={hashes}` "
            f"(`--config.model.fallback_hashes={hashes}` for configs/ctr.py), or {afresh}."
        )
    if combiner != layer.fallback_combiner:
        raise UserError(
            f"{where}: table `{layer.name}` read the {combiner} of its fallback rows there and "
            f'the {layer.fallback_combiner} here; build it with `fallback_combiner="{combiner}"` '
            f"(`--config.model.fallback_combiner={combiner}` for configs/ctr.py), or {afresh}."
        )
    raise UserError(
        f"{where}: table `{layer.name}` hashed ids into its fallback rows with seed {seed} there "
        f"and {layer.seed} here, which reads other rows; build it with `seed={seed}` "
        f"(`--config.model.table_seed={seed}` for configs/ctr.py), or {afresh}."
    )


def apply(warm: WarmStartPlan) -> str:
    """Loads what `warm` planned; returns the report line."""
    reader = tf.train.load_checkpoint(warm.checkpoint)
    for key, variable in warm.variables:
        variable.assign(np.asarray(reader.get_tensor(key)))
    parts = [pair for pairs in warm.tables.values() for pair in pairs]
    if parts:
        # The checkpoint's list of table indexes, with this model's parts where they load.
        indexes: list[tf.Module] = [tf.Module() for _ in range(max(p for p, _ in parts) + 1)]
        for position, index in parts:
            indexes[position] = index
        tf.train.Checkpoint(tables=indexes).read(warm.checkpoint).expect_partial()
    warnings = []
    for resplit in warm.resplit:
        warnings += _load_resplit(resplit, reader, warm.checkpoint)
    return "; ".join([warm.line(), *warnings])


def _no_slots(variable) -> list:
    return []  # the optimizer starts fresh: only the layer's own content moves


def _load_resplit(resplit: Resplit, reader, checkpoint: str) -> list[str]:
    """Loads a layer split otherwise there through a twin split as there; eviction warnings."""
    twin = resplit.layer.twin(resplit.parts)
    for key, variable in zip(resplit.variables, twin.variables, strict=True):
        variable.assign(np.asarray(reader.get_tensor(key)))
    if resplit.tables:
        indexes: list[tf.Module] = [tf.Module() for _ in range(max(resplit.tables) + 1)]
        for position, index in zip(resplit.tables, twin.indexes(), strict=True):
            indexes[position] = index
        tf.train.Checkpoint(tables=indexes).read(checkpoint).expect_partial()
    return resplit.layer.import_logical(twin.export_logical(_no_slots), _no_slots)
