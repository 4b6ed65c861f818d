"""The config is checked in one pass at start-up: every field that needs nothing else."""

import pytest

from tests.helpers import one_line_error, tiny_config
from trainer.data.base import Settings
from trainer.loop import checks


def test_the_checked_view_holds_what_the_build_takes():
    checked = checks.check_config(
        tiny_config(**{"train.precision": "mixed_bfloat16", "data.autotune_ram_budget_mb": 64})
    )
    assert checked == checks.Checked("mixed_bfloat16", Settings(False, 64, "auto"))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("train.precision", "float8", r"Unknown `train.precision` 'float8'"),
        ("optimizer.name", "adagradd", r"Unknown `optimizer.name` 'adagradd'"),
        ("optimizer.schedule", "linear", r"Unknown `optimizer.schedule` 'linear'"),
        ("optimizer.learning_rate", -1.0, r"`optimizer.learning_rate` \(-1.0\) must be positive"),
        ("optimizer.warmup_steps", -1, r"`optimizer.warmup_steps` \(-1\) must be >= 0"),
        ("data.sharding", "rows", r"Unknown `data.sharding` 'rows'"),
        ("data.autotune_ram_budget_mb", -1, r"`data.autotune_ram_budget_mb` \(-1\) must be >= 0"),
        ("data.service", "local:0", r"`data.service`"),
        ("train.steps_per_loop", -1, r"`train.steps_per_loop` \(-1\) must be >= 0"),
        ("train.steps_per_iteration", -2, r"`train.steps_per_iteration` \(-2\) must be >= 0"),
    ],
)
def test_each_field_that_needs_nothing_else_is_refused_in_the_one_pass(field, value, message):
    one_line_error(message, checks.check_config, tiny_config(**{field: value}))
