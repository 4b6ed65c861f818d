"""Features are components: one registered from outside the loop trains with it, unnamed there."""

import ast
import pathlib
import sys
import types

import ml_collections
import pytest
import tensorflow as tf

import strategies
from tests.helpers import one_line_error, tiny_config
from towerflow.errors import UserError
from trainer.loop import actions, component, options, train

LOOP = pathlib.Path(__file__).resolve().parent.parent / "trainer" / "loop"


class Blocks(component.Component):
    """Counts the blocks trained in a variable every checkpoint holds (`blocks.every` > 0)."""

    fields = ("blocks.every",)

    def check(self, config, traits) -> None:
        every = config.get("blocks", {}).get("every", 0)
        if every < 0:
            raise UserError(f"`blocks.every` ({every}) must be >= 0; set e.g. 1.")

    def build(self, context):
        if not context.config.get("blocks", {}).get("every", 0):
            return None
        return Counted()


class Counted(component.Feature):
    slot = component.Slot.METRICS

    def __init__(self):
        self.module = tf.Module()
        self.module.blocks = tf.Variable(0, dtype=tf.int64, trainable=False)

    def checkpoint(self):
        return {"block_count": self.module}

    def actions(self, run):
        def count(output):
            self.module.blocks.assign_add(1)
            output.metrics["blocks"] = float(self.module.blocks.numpy())

        return [actions.every_block(count, "blocks")]

    def results(self):
        return {"blocks": int(self.module.blocks.numpy())}


@pytest.fixture
def registered():
    component.register("test_blocks")(Blocks)
    yield
    del component.REGISTRY["test_blocks"]


def _config(every: int) -> ml_collections.ConfigDict:
    config = tiny_config(**{"strategy.name": "one_device"})
    config.blocks = ml_collections.ConfigDict({"every": every})
    return config


def test_a_component_from_outside_the_loop_adds_an_action_a_checkpoint_entry_and_results(
    registered, tmp_path
):
    results = train.train_and_evaluate(_config(1), str(tmp_path), mode="train")
    assert results["blocks"] == 4  # 20 steps in blocks of 5
    assert results["train"]["blocks"] == 4.0  # in the last block's metrics, before the line
    names = [name for name, _ in tf.train.list_variables(str(tmp_path / "checkpoints"))]
    assert any(name.startswith("block_count/") for name in names)


def test_a_component_left_off_by_the_config_adds_nothing(registered, tmp_path):
    job = train.build(_config(0), str(tmp_path))
    assert job.feature("test_blocks") is None and "block_count" not in train.checkpointed(job)


def test_a_components_check_stops_the_run_before_model_dir_is_written(registered, tmp_path):
    one_line_error(r"`blocks.every` \(-1\)", train.train_and_evaluate, _config(-1), str(tmp_path))
    assert not any(tmp_path.iterdir())


def test_a_name_taken_is_refused(registered):
    with pytest.raises(ValueError, match="`test_blocks` is already registered"):
        component.register("test_blocks")(Blocks)


def test_only_a_component_class_registers():
    with pytest.raises(TypeError, match="must subclass"):
        component.register("not_a_component")(Counted)


def test_the_built_in_features_are_registered_in_their_order():
    names = [each.name for each in component.registered()]
    assert names[:7] == [
        "follow",
        "input_wait",
        "tables",
        "elastic",
        "exports",
        "profile",
        "warm_start",
    ]


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return found


def test_no_loop_file_imports_a_feature():
    loop_files = sorted(LOOP.glob("*.py"))
    assert LOOP / "train.py" in loop_files and LOOP / "job.py" in loop_files
    importing = {
        path.name: sorted(name for name in _imports(path) if name.startswith(component.BUILT_IN))
        for path in loop_files
    }
    assert {name: found for name, found in importing.items() if found} == {}


def test_the_finder_of_feature_imports_would_find_one(tmp_path):
    path = tmp_path / "loop.py"
    path.write_text("from trainer.loop.features import follow\n")
    assert "trainer.loop.features.follow" in _imports(path)


@pytest.fixture
def docs_example():
    """docs/components.md's component (its first Python block), registered while a test runs."""
    page = (LOOP.parent.parent / "docs" / "components.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("docs_components_example")
    exec(compile(code, "docs/components.md", "exec"), module.__dict__)
    yield module
    del component.REGISTRY["examples_seen"]


def test_the_docs_example_counts_the_examples_across_a_resume(docs_example, tmp_path):
    config = tiny_config(**{"strategy.name": "one_device"})
    config.examples_seen = ml_collections.ConfigDict({"enabled": True})
    first = train.train_and_evaluate(config, str(tmp_path), mode="train")
    assert first["examples_seen"] == 20 * config.train.global_batch_size
    config.train.steps = 30  # resumes at step 20: the count comes back from the checkpoint
    again = train.train_and_evaluate(config, str(tmp_path), mode="train")
    assert again["examples_seen"] == 30 * config.train.global_batch_size
    assert again["train"]["examples_seen"] == again["examples_seen"]


def test_the_docs_examples_check_refuses_a_value_that_is_not_a_bool(docs_example, tmp_path):
    config = tiny_config()
    config.examples_seen = ml_collections.ConfigDict({"enabled": 3})
    message = r"`examples_seen.enabled` \(3\)"
    one_line_error(message, train.train_and_evaluate, config, str(tmp_path))


def test_the_docs_examples_section_refuses_a_field_it_does_not_declare(docs_example, tmp_path):
    config = tiny_config()
    config.examples_seen = ml_collections.ConfigDict({"enabled": True, "enabeld": True})
    message = r"`examples_seen.enabeld` is no field of `examples_seen`"
    one_line_error(message, train.train_and_evaluate, config, str(tmp_path))
    assert not any(tmp_path.iterdir())


def test_the_docs_examples_rule_names_the_field_and_the_fix(docs_example):
    config = tiny_config()
    config.examples_seen = docs_example.ExamplesSeen.section.defaults()
    config.examples_seen.metric = "examples seen"
    with pytest.raises(UserError, match=r"`examples_seen.metric` \('examples seen'\) must be"):
        component.check(config, strategies.plugin("one_device").traits)


def test_a_config_without_the_docs_examples_section_reads_its_defaults(docs_example):
    options = docs_example.ExamplesSeen().read(tiny_config())
    assert options == docs_example.ExamplesSeenOptions(enabled=False, metric="examples_seen")


def test_a_component_declares_its_fields_through_its_section(docs_example):
    assert docs_example.ExamplesSeen.fields == ("examples_seen.enabled", "examples_seen.metric")


def test_a_section_that_is_no_section_is_refused():
    class Loose(Blocks):
        section = ("blocks", dict)

    with pytest.raises(TypeError, match="must be a `component.Section`"):
        component.register("test_loose")(Loose)


def test_the_built_in_components_read_their_sections_from_the_declarations():
    sections = {each.name: each.section for each in component.registered()}
    assert sections["exports"] is options.BUILTIN["exports"]
    assert sections["follow"] is options.BUILTIN["follow"]  # named by the declarations' table
    assert {name for name, section in sections.items() if section} >= set(options.BUILTIN)


def test_the_docs_config_file_builds_the_examples_section_from_its_declaration(
    docs_example, monkeypatch
):
    """docs/components.md's config file (its second Python block), with the example importable."""
    package = types.ModuleType("my_package")
    package.examples_seen = docs_example
    monkeypatch.setitem(sys.modules, "my_package", package)
    monkeypatch.setitem(sys.modules, "my_package.examples_seen", docs_example)
    page = (LOOP.parent.parent / "docs" / "components.md").read_text()
    code = page.split("```python\n")[2].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "docs/components.md", "exec"), namespace)
    config = namespace["get_config"]()
    read = docs_example.ExamplesSeen().read(config)
    assert read == docs_example.ExamplesSeenOptions(enabled=True)
