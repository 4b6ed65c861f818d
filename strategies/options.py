"""The built-in plugins' options, declared once: one dataclass per `config.strategy.<name>`.

Each built-in plugin takes its dataclass (`class Mirrored(Strategy, options=MirroredOptions)`)
and `configs/default.py` builds its `strategy` sections from them (`sections()`), so every
default is written here only. The comments beside and above the fields are the
configuration reference's (docs/hooks/config_reference.py reads them). This module
imports no TensorFlow, so a config file may import it; a check that needs TensorFlow
belongs to the plugin, where the option is used.
"""

import dataclasses
import math

import ml_collections

from towerflow.errors import UserError

# Seconds every member waits for the others of a cluster to come up (`startup_timeout_seconds`).
STARTUP_TIMEOUT_S = 120.0
DEFAULT_MIN_SHARD_BYTES = 256 << 10  # TF's MinSizePartitioner default
# mirrored's ways to combine replicas' gradients ("auto": TensorFlow's pick for the devices).
CROSS_DEVICE_OPS = ("auto", "nccl", "hierarchical_copy", "reduce_to_one")
IMPLEMENTATIONS = ("auto", "ring", "nccl")  # multi_worker's collectives


def _one_of(field: str, value: str, known: tuple[str, ...]) -> None:
    if value not in known:
        raise UserError(f"Unknown `{field}` '{value}'; known: {', '.join(known)}.")


@dataclasses.dataclass(frozen=True)
class OneDeviceOptions:
    """`strategy.one_device`.

    Each plugin's options live under its own name, so `--strategy` swaps among them.
    """

    device: str = ""  # e.g. "/gpu:0"; "" = the first GPU, else the CPU
    gradient_dtype: str = "float32"  # one replica: nothing to all-reduce


@dataclasses.dataclass(frozen=True)
class MirroredOptions:
    """`strategy.mirrored`."""

    devices: str = ""  # comma-separated; "" = all GPUs, else all logical CPUs
    # How replicas' gradients are combined: auto | nccl | hierarchical_copy | reduce_to_one.
    cross_device_ops: str = "auto"
    # The dtype gradients are summed in across replicas: float32 | bfloat16 (half the bytes
    # sent, about 3 significant digits in the sum; the update stays float32).
    gradient_dtype: str = "float32"

    def __post_init__(self):
        _one_of("strategy.mirrored.cross_device_ops", self.cross_device_ops, CROSS_DEVICE_OPS)


@dataclasses.dataclass(frozen=True)
class CentralStorageOptions:
    """`strategy.central_storage`."""

    devices: str = ""  # compute devices, as for mirrored
    parameter_device: str = ""  # "" = the host CPU
    gradient_dtype: str = "float32"  # float32 | bfloat16, as for mirrored


@dataclasses.dataclass(frozen=True)
class MultiWorkerOptions:
    """`strategy.multi_worker`."""

    implementation: str = "auto"  # collectives: auto | ring | nccl
    gradient_dtype: str = "float32"  # float32 | bfloat16, as for mirrored
    # Gradients all-reduced in packs of about this many bytes, which overlap: "auto" (16 MB),
    # "0" (one pack) or a number of bytes.
    bytes_per_pack: str = "0"
    # Seconds a collective may wait for its peers before it fails the step; 0 = no timeout
    # (a dead or hung peer is still named within about 15-40 s by the coordination service's
    # heartbeats and the loop's watchdog). Any timeout costs one sleeping thread per
    # collective op for its whole length: keep it 0 unless you need one. Negative: refused.
    timeout_seconds: float = 0.0
    # Seconds every member waits for the others of `TF_CONFIG` to answer before it starts.
    startup_timeout_seconds: float = STARTUP_TIMEOUT_S

    def __post_init__(self):
        _one_of("strategy.multi_worker.implementation", self.implementation, IMPLEMENTATIONS)
        timeout = self.timeout_seconds
        if not math.isfinite(timeout) or timeout < 0:
            raise UserError(
                f"`strategy.multi_worker.timeout_seconds` ({timeout}) must be a finite number "
                "of seconds >= 0; use 0 (no per-collective timeout, the default) or e.g. 600."
            )


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """`strategy.pipeline`.

    Model parallelism: the model's layers in consecutive stages, one per device.
    """

    stages: int = 2  # stages, balanced by parameter count (one device each)
    # Or the layers that start stages 1, 2, ... by name, e.g. "dense_1,dense_2" (then 3 stages).
    boundaries: str = ""
    micro_batches: int = 4  # GPipe: parts of each train batch, so stages overlap
    devices: str = ""  # one per stage; "" = the GPUs, else the logical CPUs

    def __post_init__(self):
        if int(self.micro_batches) < 1:
            raise UserError(
                f"`strategy.pipeline.micro_batches` ({self.micro_batches}) must be >= 1 "
                "(1 = no micro-batches)."
            )
        no_boundaries = not str(self.boundaries).replace(",", "").strip()  # only commas, spaces
        if no_boundaries and int(self.stages) < 1:
            raise UserError(
                f"`strategy.pipeline.stages` ({self.stages}) must be >= 1; e.g. "
                "`--config.strategy.pipeline.stages=2`."
            )


@dataclasses.dataclass(frozen=True)
class ParameterServerOptions:
    """`strategy.parameter_server`."""

    # How big variables of `trainer.layers` are split over the ps members:
    # none (whole variables, round-robin) | fixed | min_size | max_size.
    partitioner: str = "none"
    num_shards: int = 2  # fixed: shards per big variable
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES  # min_size: bytes (<= 1 shard per ps)
    max_shard_bytes: int = 64 << 20  # max_size: largest shard in bytes
    # Seconds every member waits for the others of `TF_CONFIG` to answer before it starts.
    startup_timeout_seconds: float = STARTUP_TIMEOUT_S
    # Spare replicas: each update averages the first k of the n workers' gradients, late ones
    # are dropped (synchronous; k = n: no spare). 0 = asynchronous, each worker updates alone.
    sync_replicas: int = 0
    # Asynchronous: what an update does about the updates applied since its worker read the
    # variables (its staleness, recorded in TensorBoard either way): none | scale (gradient
    # divided by 1 + staleness) | drop_above=N (updates staler than N discarded).
    staleness: str = "none"
    warmup_steps: int = 0  # asynchronous: first steps on one worker alone
    # Workers push float32 gradients to the ps; nothing is all-reduced (float32 only).
    gradient_dtype: str = "float32"

    def __post_init__(self):
        if self.warmup_steps < 0:
            raise UserError(
                f"`strategy.parameter_server.warmup_steps` ({self.warmup_steps}) must be >= 0 "
                "(0 = every worker from the first step)."
            )


# The built-in plugins' names (`@register`) -> their options, in the config's order.
BUILTIN = {
    "one_device": OneDeviceOptions,
    "mirrored": MirroredOptions,
    "central_storage": CentralStorageOptions,
    "multi_worker": MultiWorkerOptions,
    "pipeline": PipelineOptions,
    "parameter_server": ParameterServerOptions,
}


def sections() -> ml_collections.ConfigDict:
    """`config.strategy`'s plugin sections: each built-in plugin's options at their defaults.

    Returns:
      A `ConfigDict` of one `ConfigDict` per built-in plugin, under the plugin's name.
    """
    return ml_collections.ConfigDict(
        {name: dataclasses.asdict(options()) for name, options in BUILTIN.items()}
    )
