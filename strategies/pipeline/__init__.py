"""`pipeline`: model parallelism, a model's layers split into stages on several devices.

The model's layers, in order, are cut into consecutive *stages*, one per
device (GPUs, else the logical CPUs of `devices.logical_cpus`): balanced by
parameter count (`strategy.pipeline.stages`), or at the layers named in
`strategy.pipeline.boundaries`, each of which starts a stage. A stage's
variables (and the optimizer's slots for them) live on its device, and its
forward and backward passes run there; only the activations between stages
(and their gradients) cross devices.

GPipe-style, each training batch is split into `strategy.pipeline.micro_batches`
parts that flow through the stages one after another, so stage 1 works on
micro-batch 0 while stage 0 works on micro-batch 1: the steps are one dataflow
graph, and TensorFlow runs every op whose inputs are ready. The model's
outputs are the micro-batches' outputs put back together, so the loss, its
gradients (summed over micro-batches) and the update are those of the whole
global batch, as under `one_device` (up to float rounding).

What splits: Keras Sequential models, and functional models whose graph is a
chain of stages: exactly one tensor crosses each boundary (anything may
branch and merge inside a stage). Layers that see the batch as a whole
differ with micro-batches: `BatchNormalization` normalises each micro-batch
by its own statistics (as in GPipe), and dropout draws other masks; with
`micro_batches = 1` both match `one_device`. Evaluation runs the stages
without micro-batches; export runs the plain model (one device).

How the model runs by stages: the trainer builds the model inside `scope()`
(variables on the host) and hands it to `place_model`, which moves each
stage's variables to its device and makes the model's call run stage by
stage while this plugin's step loops are traced. The trainer's step is the
ordinary one. Where the model is cut: `strategies.pipeline.cuts`; how the
stages run: `strategies.pipeline.stages`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras
import ml_collections
import tensorflow as tf

from strategies import devices, tf_patches
from strategies.base import DatasetFn, StepFn, Strategy, Traits, read_options
from strategies.options import PipelineOptions
from strategies.pipeline.cuts import balanced_cuts, layers_and_cuts, named_cuts, symbolic
from strategies.pipeline.stages import Stage, move, run_by_stages
from strategies.registry import register
from towerflow.errors import UserError


@register("pipeline")
class Pipeline(Strategy, options=PipelineOptions):
    """Model parallelism: consecutive layers in stages on GPUs (else logical CPUs), GPipe."""

    traits = Traits(jit_compile=False)  # variables live away from the devices that compute

    @classmethod
    def local_replicas(cls, options: ml_collections.ConfigDict | None, logical_cpus: int) -> int:
        # One replica, but its stages compute side by side: each op gets one stage's
        # share of the cores (see `devices.op_threads`).
        return _stage_count(read_options(cls, options))

    def build_tf_strategy(self) -> tf.distribute.Strategy:
        self.micro_batches = int(self.options.micro_batches)  # >= 1: `PipelineOptions`
        self.boundaries = _names(self.options.boundaries)
        count = _stage_count(self.options)
        found = devices.parse_devices(self.options.devices, "strategy.pipeline.devices")
        if len(found) < count:
            raise UserError(
                f"`strategy.pipeline` has {count} stages, one per device, and only "
                f"{len(found)} device(s) are in use ({', '.join(found)}); lower "
                "`strategy.pipeline.stages` or raise `devices.logical_cpus` (no GPUs)."
            )
        self.devices = found[:count]
        self.stages: list[Stage] = []  # set by `place_model`
        self._staged = False  # the model runs by stages (while our loops are traced)
        return tf.distribute.get_strategy()  # one replica; placement is done by hand

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Variables are made on the host; `place_model` moves each to its stage's device."""
        with self.tf_strategy.scope(), tf.device("/device:CPU:0"):
            yield

    def place_model(self, model: keras.Model) -> None:
        """Cuts `model` into stages, moves their variables, and makes its call run by stages.

        Raises:
          UserError: the model cannot be cut as asked (a branch crosses a
            boundary, an unknown layer name, fewer layers than stages).
        """
        layers, cuts = layers_and_cuts(model)
        starts = (
            named_cuts(self.boundaries, layers, cuts)
            if self.boundaries
            else balanced_cuts(len(self.devices), layers, cuts)
        )
        starts = [0, *starts, len(layers)]
        spans = list(zip(self.devices, starts, starts[1:], strict=False))
        for device, a, b in spans:
            for layer in layers[a:b]:
                for variable in layer.variables:
                    move(variable, device)
        self.stages = [
            Stage(
                device,
                layers[a:b],
                cuts[a] if a else symbolic(model, "input"),
                cuts[b] if b < len(layers) else symbolic(model, "output"),
            )
            for device, a, b in spans
        ]
        plain_call = model.call

        def call(inputs, training=None, mask=None, **kwargs):
            if not self._staged:  # e.g. export, or a call outside training and evaluation
                return plain_call(inputs, training=training, mask=mask, **kwargs)
            micro = self.micro_batches if training else 1
            return run_by_stages(self.stages, inputs, micro, training)

        tf_patches.replace_call(model, call)

    @contextlib.contextmanager
    def _by_stages(self) -> Iterator[None]:
        self._staged = True
        try:
            yield
        finally:
            self._staged = False

    def run_steps(self, step_fn: StepFn, iterator, n: int) -> dict[str, float]:
        """Runs `n` steps, the model by stages (traced so on the first call)."""
        with self._by_stages():
            return super().run_steps(step_fn, iterator, n)

    def evaluate(self, step_fn: StepFn, dataset_fn: DatasetFn) -> dict[str, float]:
        """One pass over `dataset_fn`, the model by stages without micro-batches."""
        with self._by_stages():
            return super().evaluate(step_fn, dataset_fn)

    @property
    def compute_devices(self) -> list[str]:
        return list(self.devices)

    @property
    def communication(self) -> str:
        layout = (
            " -> ".join(
                f"stage {i} on {s.device} ({', '.join(layer.name for layer in s.layers)})"
                for i, s in enumerate(self.stages)
            )
            or f"{len(self.devices)} stages on {', '.join(self.devices)}"
        )
        return (
            f"activations of {self.micro_batches} micro-batch(es) flow forward, and their "
            f"gradients back, between consecutive stages: {layout}; each stage's variables "
            "stay on its device"
        )

    def describe(self, variables=()) -> dict:
        """As the base, plus `stages`: each stage's device and layer names, in order."""
        described = super().describe(variables)
        described["micro_batches"] = self.micro_batches
        described["stages"] = [
            {"device": s.device, "layers": [layer.name for layer in s.layers]} for s in self.stages
        ]
        return described


def _names(spec: str) -> list[str]:
    return [n.strip() for n in str(spec).split(",") if n.strip()]


def _stage_count(options: ml_collections.ConfigDict) -> int:
    names = _names(options.boundaries)
    return len(names) + 1 if names else int(options.stages)
