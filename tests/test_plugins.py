"""Third-party strategy plugins found through real entry points of installed packages.

Each test installs small packages the way pip lays them out (a module and a
`*.dist-info` directory with `METADATA` and `entry_points.txt`) into a
directory on `sys.path`, where `importlib.metadata` finds them. The plugin
contract is public and kept across releases: a plugin written to towerflow
0.1's interface trains with one deprecation line, one written to today's
(docs/plugins.md's example) without, and one lacking a hook is refused in one
line naming it.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys
import warnings

import ml_collections
import pytest
import tensorflow as tf

import configs.default
import strategies
import strategies.options as strategy_options
import trainer
from strategies import registry
from strategies.base import NoOptions, read_options
from tests.helpers import REPO, cli_in_process, tiny_config


def _install(site: pathlib.Path, package: str, entry_points: dict[str, str], module: str = ""):
    """Lays out `package` (distribution name) in `site`: its entry points and a module."""
    dist_info = site / f"{package.replace('-', '_')}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n")
    lines = [f"{name} = {value}" for name, value in entry_points.items()]
    (dist_info / "entry_points.txt").write_text(
        f"[{registry.ENTRY_POINT_GROUP}]\n" + "\n".join(lines) + "\n"
    )
    if module:
        (site / f"{package.replace('-', '_')}.py").write_text(module)


@pytest.fixture
def site(tmp_path):
    """A directory on `sys.path` to install packages into; the registry forgets them after."""
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.endswith("_plugin") and m != "tests.toy_plugin"]:
            del sys.modules[name]
        registry.rescan()


BROKEN = "import towerflow_test_no_such_module\n"
WORKING = "from tests.toy_plugin import Toy as Plugin\n"
# The plugin of issue 45, written to the interface towerflow 0.1 documented: `Options`,
# `_build()`, a `communication` property, a `local_replicas` classmethod, `supports_*`.
PREVIOUS_INTERFACE = '''"""Mirrored over two CPUs, gradients reduced to one device."""

import dataclasses

import tensorflow as tf
from strategies import Strategy


@dataclasses.dataclass(frozen=True)
class ReduceToOneOptions:
    devices: str = "/cpu:0,/cpu:1"


class MirroredReduceToOne(Strategy):
    """Mirrored over two CPUs, gradients reduced to one device."""

    Options = ReduceToOneOptions
    supports_jit_compile = False

    @classmethod
    def local_replicas(cls, options, logical_cpus):
        return 2

    def _build(self):
        return tf.distribute.MirroredStrategy(
            self.options.devices.split(","), cross_device_ops=tf.distribute.ReductionToOneDevice()
        )

    @property
    def communication(self):
        return "gradients reduced to /cpu:0"
'''
DEPRECATED = "uses the plugin interface of towerflow 0.1"


def _docs_plugin() -> str:
    """The plugin docs/plugins.md writes, today's interface: its first Python block."""
    page = pathlib.Path(REPO, "docs", "plugins.md").read_text()
    return re.search(r"```python\n(.*?)```", page, re.S).group(1)


def test_a_name_claimed_by_a_package_and_towerflow_names_both(site):
    _install(site, "rival-plugin", {"mirrored": "rival_plugin:Plugin"}, WORKING)
    with pytest.raises(strategies.UserError) as error:
        registry.rescan()
    message = str(error.value)
    assert "Strategy `mirrored` is claimed twice" in message
    assert "package `rival-plugin` (entry point `mirrored = rival_plugin:Plugin`)" in message
    assert "package `towerflow`" in message


def test_a_name_claimed_by_two_packages_names_both(site):
    _install(site, "first-plugin", {"toy": "first_plugin:Plugin"}, WORKING)
    _install(site, "second-plugin", {"toy": "second_plugin:Plugin"}, WORKING)
    with pytest.raises(strategies.UserError, match="`toy` is claimed twice") as error:
        registry.rescan()
    assert "`first-plugin`" in str(error.value) and "`second-plugin`" in str(error.value)


def test_plugins_load_when_used(site):
    _install(site, "lazy-plugin", {"lazy": "lazy_plugin:Plugin"}, WORKING)
    registry.rescan()
    assert strategies.get("one_device").num_replicas_in_sync == 1
    assert "lazy_plugin" not in sys.modules  # using another strategy does not import it
    lazy = strategies.get("lazy")
    assert lazy.name == "lazy" and lazy.num_replicas_in_sync == 1
    assert strategies.available()["lazy"] == "A third-party plugin, for the registry test."


def test_a_broken_plugin_breaks_only_its_own_commands(site):
    _install(site, "broken-plugin", {"broken": "broken_plugin:Plugin"}, BROKEN)
    registry.rescan()
    assert strategies.get("one_device").num_replicas_in_sync == 1
    listed = strategies.available()
    assert listed["broken"] == (
        "(broken: ModuleNotFoundError: No module named 'towerflow_test_no_such_module')"
    )
    assert listed["one_device"] and listed["mirrored"]
    with pytest.raises(strategies.UserError) as error:
        strategies.get("broken")
    message = str(error.value)
    assert "package `broken-plugin`" in message and "towerflow_test_no_such_module" in message
    assert "\n" not in message


def test_a_broken_plugin_on_the_command_line(site, tmp_path, capsys):
    _install(site, "broken-plugin", {"broken": "broken_plugin:Plugin"}, BROKEN)
    registry.rescan()
    code, out, err = cli_in_process("--list_strategies", capsys=capsys, cwd=tmp_path)
    assert code == 0, err[-3000:]
    assert "broken           (broken: ModuleNotFoundError" in out
    assert "one_device" in out
    code, _, err = cli_in_process(
        "--strategy=broken", f"--model_dir={tmp_path / 'run'}", capsys=capsys, cwd=tmp_path
    )
    assert code == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "package `broken-plugin`" in lines[0], err
    assert not (tmp_path / "run").exists()


# --- the plugin contract, kept across releases -----------------------------------------------


def _train(tmp_path, capsys, name: str) -> tuple[int, str, str]:
    """`towerflow --strategy=NAME` for 4 steps in this process, the packages in `site` installed."""
    registry.rescan()
    flags = ["--config.train.steps=4", "--config.train.steps_per_loop=2", "--mode=train"]
    return cli_in_process(
        f"--strategy={name}", "--model_dir=run", *flags, capsys=capsys, cwd=tmp_path
    )


def test_an_installed_plugin_of_the_previous_interface_trains_with_one_deprecation_line(
    site, tmp_path, capsys
):
    entry = {"reduce_to_one": "old_plugin:MirroredReduceToOne"}
    _install(site, "old-plugin", entry, PREVIOUS_INTERFACE)
    code, out, err = _train(tmp_path, capsys, "reduce_to_one")
    assert code == 0, err[-3000:]
    assert "strategy: reduce_to_one | replicas: 2" in out
    assert "step: 4/4" in out
    (line,) = [line for line in err.splitlines() if DEPRECATED in line]
    assert line == (
        "warning: strategy plugin `old_plugin.MirroredReduceToOne` uses the plugin interface "
        "of towerflow 0.1, which works until towerflow 0.3: rename `_build` to "
        "`build_tf_strategy`, `Options = ReduceToOneOptions` to "
        "`class MirroredReduceToOne(Strategy, options=ReduceToOneOptions)`, "
        "`supports_jit_compile` to `traits.jit_compile` (see docs/plugins.md)."
    )


def test_an_installed_plugin_of_todays_interface_trains_without_a_deprecation_line(
    site, tmp_path, capsys
):
    _install(site, "my-plugin", {"my_strategy": "my_plugin:MyStrategy"}, _docs_plugin())
    registry.rescan()
    config = tiny_config(**{"strategy.name": "my_strategy", "train.steps": 4})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = trainer.train_and_evaluate(config, str(tmp_path / "run"))
    assert results["step"] == 4
    assert results["placement"]["communication"] == "what crosses devices each step"
    assert not [w for w in caught if DEPRECATED in str(w.message)]
    assert DEPRECATED not in capsys.readouterr().err


def test_hooks_of_the_private_names_interface_work_under_their_public_names_with_one_warning(
    capsys,
):
    with pytest.warns(DeprecationWarning, match=DEPRECATED) as caught:

        class Private(strategies.Strategy):
            @classmethod
            def _local_replicas(cls, options, logical_cpus):
                return 3

            def _build(self):
                return tf.distribute.OneDeviceStrategy("/cpu:0")

            @property
            def _communication(self):
                return "none"

            @property
            def _compute_devices(self):
                return ["the one CPU"]

    assert [w.filename for w in caught] == [__file__]  # points at the plugin's class
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(
        "rename `_build` to `build_tf_strategy`, `_communication` to `communication`, "
        "`_local_replicas` to `local_replicas`, `_compute_devices` to `compute_devices` "
        "(see docs/plugins.md)."
    )
    described = Private().describe()
    assert (described["communication"], described["compute_devices"]) == ("none", ["the one CPU"])
    assert strategies.local_replicas(Private, None, 4) == 3


def test_an_old_plugin_that_extends_a_builtin_one_reaches_its_hooks_by_their_old_names():
    from strategies.mirrored import Mirrored  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)

        class Extended(Mirrored):
            def _build(self):
                self.from_mirrored = super()._build()
                return self.from_mirrored

            @property
            def _communication(self):
                return super()._communication + "; and a log line"

    plugin = Extended()
    assert plugin.tf_strategy is plugin.from_mirrored and plugin.num_replicas_in_sync > 1
    assert plugin.communication.startswith("gradients all-reduced across")
    assert plugin.communication.endswith("; and a log line")


def test_traits_an_old_plugin_gives_as_flags_or_properties_are_its_traits(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)

        class Flags(strategies.Strategy):
            supports_loss_scaling = False

            def build_tf_strategy(self):
                return tf.distribute.OneDeviceStrategy("/cpu:0")

            @property
            def communication(self):
                return "none"

            @property
            def ordered_input(self):  # read from the built plugin
                return False

    assert "`supports_loss_scaling` to `traits.loss_scaling`" in capsys.readouterr().err
    assert not Flags.traits.loss_scaling
    built = Flags().traits
    assert (built.jit_compile, built.loss_scaling, built.ordered_input) == (True, False, False)


def test_a_plugin_of_todays_interface_gets_no_warning(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Today(strategies.Strategy):
            def build_tf_strategy(self):
                return tf.distribute.OneDeviceStrategy("/cpu:0")

            @property
            def communication(self):
                return "none"

    assert Today().communication == "none" and not capsys.readouterr().err


INCOMPLETE = """from strategies import Strategy


class Incomplete(Strategy):
    \"\"\"Implements no hook.\"\"\"

    def build(self):
        pass
"""


def test_a_plugin_that_implements_no_hook_is_refused_in_one_line_naming_them(site):
    _install(site, "incomplete-plugin", {"incomplete": "incomplete_plugin:Incomplete"}, INCOMPLETE)
    registry.rescan()
    with pytest.raises(strategies.UserError) as error:
        strategies.get("incomplete")
    assert str(error.value) == (
        "Strategy `incomplete` from package `incomplete-plugin` (entry point `incomplete = "
        "incomplete_plugin:Incomplete`) does not implement `build_tf_strategy`, `communication` "
        "(the plugin contract: docs/plugins.md); fix or uninstall that package, or pick another "
        "`--strategy`."
    )
    assert strategies.available()["incomplete"] == (
        "(broken: does not implement `build_tf_strategy`, `communication` (the plugin contract: "
        "docs/plugins.md))"
    )
    with pytest.raises(strategies.UserError, match="does not implement"):  # and at every use
        strategies.plugin("incomplete")


# --- options: each plugin declares its own, once ---------------------------------------------


def test_the_config_sections_are_the_options_the_builtin_plugins_take():
    # configs/default.py builds `strategy.<name>` from `strategies.options.BUILTIN` (it may
    # not import the plugins): that table must name each plugin's own options dataclass.
    plugins = [strategies.plugin(name) for name in strategies.available()]
    with_options = {
        plugin.name: plugin._options_type
        for plugin in plugins
        if plugin.__module__ in registry.BUILTIN_MODULES and plugin._options_type is not NoOptions
    }
    assert with_options == strategy_options.BUILTIN
    sections = configs.default.get_config().strategy
    assert {name: sections[name].to_dict() for name in with_options} == {
        name: read_options(strategies.plugin(name), None).to_dict() for name in with_options
    }


def test_no_builtin_plugin_repeats_an_options_default_in_code():
    for module in registry.BUILTIN_MODULES:
        source = inspect.getsource(importlib.import_module(module))
        assert not re.search(r"options\.get\(", source), module


def test_an_option_a_plugin_does_not_declare_is_one_line():
    with pytest.raises(strategies.UserError) as e:
        strategies.get("one_device", ml_collections.ConfigDict({"devcie": "/cpu:0"}))
    assert str(e.value) == (
        "`strategy.one_device.devcie` is no option of `one_device`; its options: device, "
        "gradient_dtype (as the plugin declares them)."
    )


TIMEOUT_RULE = (
    "must be a finite number of seconds >= 0; use 0 (no per-collective timeout, the default) "
    "or e.g. 600."
)


@pytest.mark.parametrize(
    "name, field, value, message",
    [
        ("multi_worker", "timeout_seconds", -1.0, TIMEOUT_RULE),
        ("multi_worker", "timeout_seconds", float("nan"), TIMEOUT_RULE),
        ("multi_worker", "timeout_seconds", float("inf"), TIMEOUT_RULE),
        ("pipeline", "micro_batches", 0, "must be >= 1 (1 = no micro-batches)."),
        ("pipeline", "stages", 0, "must be >= 1; e.g. `--config.strategy.pipeline.stages=2`."),
        (
            "parameter_server",
            "warmup_steps",
            -1,
            "must be >= 0 (0 = every worker from the first step).",
        ),
    ],
)
def test_a_value_no_run_can_use_is_one_line_where_the_options_are_read(name, field, value, message):
    section = ml_collections.ConfigDict({field: value})
    with pytest.raises(strategies.UserError) as error:
        read_options(strategies.plugin(name), section)
    assert str(error.value) == f"`strategy.{name}.{field}` ({value}) {message}"


def test_an_unknown_cross_device_ops_is_refused_where_the_options_are_read():
    section = ml_collections.ConfigDict({"cross_device_ops": "ring"})
    with pytest.raises(strategies.UserError) as error:
        read_options(strategies.plugin("mirrored"), section)
    assert str(error.value) == (
        "Unknown `strategy.mirrored.cross_device_ops` 'ring'; "
        "known: auto, nccl, hierarchical_copy, reduce_to_one."
    )


def test_a_collective_timeout_of_0_means_none():
    described = strategies.get("multi_worker").describe()["communication"]
    assert "no per-collective timeout" in described


def test_a_third_party_plugin_reads_the_options_it_declares():
    from tests.toy_plugin import Toy  # noqa: PLC0415

    Toy.name = "toy"  # as `@register` or its entry point names it
    assert Toy().options.device == "/cpu:0"  # its declared default, with no config section
    chosen = Toy(ml_collections.ConfigDict({"device": "/cpu:1"}))
    assert (
        chosen.options.device == "/cpu:1"
        and "CPU:1" in chosen.tf_strategy.extended.worker_devices[0]
    )
    with pytest.raises(strategies.UserError, match=r"`strategy.toy.speed` is no option of `toy`"):
        Toy(ml_collections.ConfigDict({"speed": 2}))


def _listed(docstring: str, after: str, until: str) -> set[str]:
    """The names in backticks in `docstring` between `after` and `until` (`name`, `name(...)`)."""
    text = re.search(f"{after}(.*?){until}", docstring, re.S).group(1)
    return set(re.findall(r"`(\w+)[`(]", text))


def test_the_strategy_interface_is_the_sixteen_members_its_docstring_lists_and_the_hooks():
    from strategies import base  # noqa: PLC0415

    plugin = strategies.get("one_device")
    public = {n for n in {*dir(type(plugin)), *vars(plugin)} if not n.startswith("_")}
    interface = _listed(base.__doc__, "The interface the loop uses:", "Those 16")
    hooks = _listed(base.__doc__, "The hooks a plugin implements, its public contract:", "With")
    assert len(interface) == 16 and hooks == {
        "build_tf_strategy",
        "communication",
        "local_replicas",
        "compute_devices",
    }
    assert public == interface | hooks, sorted(public ^ (interface | hooks))


def test_an_installed_plugins_options_take_overrides_from_a_users_config(site, tmp_path, capsys):
    """docs/plugins.md's config: the plugin's section from its declared defaults, then flags."""
    _install(site, "toy-plugin", {"toy": "toy_plugin:Plugin"}, WORKING)
    registry.rescan()
    (tmp_path / "my_config.py").write_text(
        "import dataclasses\n\nimport ml_collections\nfrom configs import default\n"
        "from tests.toy_plugin import ToyOptions\n\n\ndef get_config():\n"
        "    c = default.get_config()\n    c.strategy.name = 'toy'\n"
        "    c.strategy.toy = ml_collections.ConfigDict(dataclasses.asdict(ToyOptions()))\n"
        "    c.train.steps = 20\n    c.eval.steps = 2\n    return c\n"
    )
    flags = ["--config=my_config.py", "--model_dir=run", "--mode=train"]
    code, out, err = cli_in_process(
        *flags, "--config.strategy.toy.device=/cpu:1", capsys=capsys, cwd=tmp_path
    )
    assert code == 0, err[-3000:]
    assert (
        "strategy: toy | replicas: 1 | devices: /job:localhost/replica:0/task:0/device:CPU:1" in out
    )
    assert "step: 20/20" in out
