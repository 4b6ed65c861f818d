"""Config sections declared once: typed dataclasses, read and checked at start-up.

`towerflow.sections` (the reading), the built-in components' declarations
(`trainer.loop.options`) and `configs/default.py`, which builds their fields from them.
"""

import dataclasses
import doctest
import re
import textwrap
import typing

import ml_collections
import pytest

import configs.default
from tests.helpers import cli_in_process, one_line_error
from towerflow import sections
from towerflow.errors import UserError
from trainer.loop import options


@dataclasses.dataclass(frozen=True)
class Toy:
    """`toy`."""

    count: int = 3  # toys
    rate: float = 0.5  # per second
    on: bool = False  # at all
    steps: tuple[int, ...] = ()  # (start, stop)
    label: str | None = None  # a name, or none


TOY = sections.Section("toy", Toy)


def _config(**toy) -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"toy": toy, "other": {"x": 1}})


def test_the_modules_docstring_example_runs():
    assert doctest.testmod(sections, raise_on_error=True).attempted >= 1


def test_a_section_reads_the_configs_values_as_its_dataclass():
    read = TOY.read(_config(count=5, rate=2, on=True, steps=[1, 2], label="x"))
    assert read == Toy(count=5, rate=2.0, on=True, steps=(1, 2), label="x")
    assert isinstance(read.rate, float) and isinstance(read.steps, tuple)


def test_a_field_the_config_lacks_takes_its_declared_default():
    assert TOY.read(_config(count=7)) == Toy(count=7)
    assert TOY.read(ml_collections.ConfigDict({"other": {"x": 1}})) == Toy()


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("count", "5", r"`toy.count` \('5'\) must be an int; set e.g. `--config.toy.count=3`\."),
        ("count", True, r"`toy.count` \(True\) must be an int"),
        ("rate", "fast", r"`toy.rate` \('fast'\) must be a number"),
        ("on", 1, r"`toy.on` \(1\) must be True or False"),
        ("steps", (1, "2"), r"`toy.steps` \(\(1, '2'\)\) must be a tuple of ints"),
        ("label", 3, r"`toy.label` \(3\) must be a string or None"),
    ],
)
def test_a_value_of_another_type_is_one_line_naming_the_field_the_value_and_the_fix(
    field, value, expected
):
    one_line_error(expected, TOY.read, _config(**{field: value}))


def test_a_section_of_its_own_refuses_a_field_it_does_not_declare():
    one_line_error(
        r"`toy.cuont` is no field of `toy`; its fields: count, rate", TOY.read, _config(cuont=1)
    )


def test_a_value_where_the_section_should_be_is_one_line():
    one_line_error(
        r"`toy` \(True\) must be a section of fields",
        TOY.read,
        ml_collections.ConfigDict({"toy": True}),
    )


def test_a_shared_section_reads_only_its_own_fields():
    shared = sections.Section("toy", Toy, shared=True)
    assert shared.read(_config(count=2, something_else="x")) == Toy(count=2)


def test_the_defaults_are_a_config_section_of_the_declared_values():
    assert TOY.defaults().to_dict() == dataclasses.asdict(Toy())
    assert TOY.fields == ("toy.count", "toy.rate", "toy.on", "toy.steps", "toy.label")


def test_only_a_dataclass_declares_a_section():
    with pytest.raises(TypeError, match="is not a dataclass"):
        sections.Section("toy", dict)


def _at(config, dotted):
    for key in dotted.split("."):
        config = config[key]
    return config


@pytest.mark.parametrize("name", sorted(options.BUILTIN))
def test_the_default_configs_fields_are_the_declared_defaults(name):
    section = options.BUILTIN[name]
    default = configs.default.get_config()
    declared = dataclasses.asdict(section.options())
    assert {field: _at(default, f"{section.path}.{field}") for field in declared} == declared
    assert section.read(default) == section.options()


@pytest.mark.parametrize("name", sorted(options.BUILTIN))
def test_each_declarations_docstring_names_where_its_fields_sit(name):
    """The configuration reference finds a declaration by its docstring: it must agree."""
    section = options.BUILTIN[name]
    opening = f"`{section.path}`" + ("" if section.shared else ".")
    assert section.options.__doc__.startswith(opening)
    assert section.shared or not section.options.__doc__.startswith(f"`{section.path}`:")


def test_a_config_file_that_sets_the_fields_the_old_way_still_reads():
    """A user config written before the declarations: whole sections, some fields left out."""
    config = configs.default.get_config()
    config.export = ml_collections.ConfigDict({"every_steps": 8})  # no `every_secs`, no `keep`
    config.train.profile_steps = (2, 4)
    del config.cluster["elastic"]  # a config made before elastic groups
    assert options.BUILTIN["exports"].read(config) == options.ExportOptions(every_steps=8)
    assert options.BUILTIN["profile"].read(config).profile_steps == (2, 4)
    assert options.BUILTIN["elastic"].read(config) == options.ElasticOptions()


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"export.keep": -1}, "`export.keep` (-1) must be >= 0 (export versions kept; 0 = all)"),
        ({"export.every_secs": -2.0}, "`export.every_secs` (-2.0) must be >= 0"),
        ({"train.profile_steps": (3, 1)}, "`train.profile_steps` ((3, 1)) must be (start, stop)"),
        ({"cluster.elastic.cooldown_s": -1.0}, "`cluster.elastic.cooldown_s` (-1.0) must be >= 0"),
    ],
)
def test_a_declarations_rule_is_one_line(fields, expected):
    config = configs.default.get_config()
    config.update_from_flattened_dict(fields)
    name = {"export": "exports", "train": "profile", "cluster": "elastic"}
    section = options.BUILTIN[name[next(iter(fields)).split(".")[0]]]
    one_line_error(re.escape(expected), section.read, config)


def test_a_config_file_with_a_value_of_another_type_exits_2_before_model_dir_is_written(
    tmp_path, capsys
):
    path = tmp_path / "my_config.py"
    path.write_text(
        textwrap.dedent(
            """
            import ml_collections
            import trainer


            def get_config():
                c = trainer.default_config()
                c.export = ml_collections.ConfigDict({"every_steps": "10"})
                return c
            """
        )
    )
    run = tmp_path / "run"
    code, _, err = cli_in_process(f"--config={path}", f"--model_dir={run}", capsys=capsys)
    assert code == 2, err
    assert "`export.every_steps` ('10') must be an int" in err and err.count("\n") == 1, err
    assert not run.exists()


def test_a_rule_of_a_declaration_refuses_a_config_before_the_build():
    from trainer.loop import checks

    config = configs.default.get_config()
    config.export.keep = -1
    with pytest.raises(UserError, match=r"`export.keep` \(-1\)"):
        checks.check_config(config)


def test_a_declaration_whose_annotations_cannot_be_resolved_is_read_by_its_rules_alone():
    @dataclasses.dataclass(frozen=True)
    class Plugins:
        """A plugin's options, typed with a name imported only to type-check."""

        hosts: "HostList" = ()  # noqa: F821
        count: "int" = 1

    read = sections.Section("strategy.mine", Plugins).parse({"hosts": ("a", "b"), "count": 2})
    assert read == Plugins(hosts=("a", "b"), count=2)


def test_a_field_declared_any_takes_any_value():
    @dataclasses.dataclass(frozen=True)
    class Loose:
        """A plugin's options, one of any type."""

        anything: typing.Any = None

    assert sections.Section("strategy.loose", Loose).parse({"anything": {"a": 1}}).anything == {
        "a": 1
    }
