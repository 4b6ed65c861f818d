"""The ctr model's table options (`model.embedding`, `model.capacity`, ...), declared once.

`trainer.loop.options.TableOptions` declares them; configs/ctr.py builds its fields from
it, the `tables` component checks them at start-up and the ctr builder reads them.
"""

import dataclasses
import importlib.util
import inspect
import os

import pytest

import configs.default
from tests.helpers import REPO
from towerflow.errors import UserError
from trainer.layers import DynamicEmbedding, tables
from trainer.loop import checks, options

TABLES = options.TABLES


def _ctr_config():
    path = os.path.join(REPO, "configs", "ctr.py")
    spec = importlib.util.spec_from_file_location("ctr_for_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def test_configs_ctr_holds_the_declared_table_fields_at_their_defaults():
    declared = dataclasses.asdict(options.TableOptions())
    model = _ctr_config().model.to_dict()
    assert {name: model[name] for name in declared} == declared


def test_the_declared_dynamic_table_defaults_are_the_layers_own():
    layer = inspect.signature(DynamicEmbedding.__init__).parameters
    declared = options.TableOptions()
    same_name = ("min_count", "ttl_steps", "eviction", "fallback_rows", "fallback_hashes")
    same_name += ("fallback_combiner", "sketch_width", "sketch_depth", "seen_bits")
    assert {name: getattr(declared, name) for name in same_name} == {
        name: layer[name].default for name in same_name
    }
    assert declared.table_seed == layer["seed"].default
    assert set(options.EVICTIONS) == {e or "" for e in tables.EVICTIONS}  # "" is the layer's None
    assert options.FALLBACK_COMBINERS == tables.FALLBACK_COMBINERS


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("embedding", "sparse", "`model.embedding` 'sparse' is not a table kind; use one of"),
        ("min_count", 0, "`model.min_count` (0) must be >= 1"),
        ("ttl_steps", -1, "`model.ttl_steps` (-1) must be >= 0"),
        ("capacity", "big", "`model.capacity` ('big') must be an int"),
    ],
)
def test_a_bad_table_option_stops_the_start_up_check_in_one_line(field, value, message):
    config = _ctr_config()
    config.model.unlock()  # a value of another type, as a config file could write it
    del config.model[field]
    config.model[field] = value
    with pytest.raises(UserError) as error:
        checks.check_config(config)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_default_config_has_no_table_fields_and_reads_their_defaults():
    config = configs.default.get_config()
    assert "embedding" not in config.model
    assert TABLES.read(config) == options.TableOptions()
