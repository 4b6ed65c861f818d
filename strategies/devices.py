"""Device setup, done once before TensorFlow starts its runtime.

Splitting the host CPU into logical devices lets `mirrored` and
`central_storage` run real multi-replica code on a machine without GPUs.
"""

from __future__ import annotations

import os

import tensorflow as tf
from absl import logging

from towerflow.errors import UserError

# TensorFlow's own pool for CPU tensors (its BFC allocator) where the environment does not
# choose: a process that builds a `from_generator` dataset (every source of `trainer.data`)
# otherwise gets each buffer of 128 KB or more from the kernel anew (TensorFlow's
# `ApplyPython311MemoryPatch` sets glibc's mmap threshold there), and faults its pages in at
# every step: the census example spent as much CPU in the kernel as in its own work.
CPU_POOL_VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"


def configure(
    logical_cpus: int = 0,
    gpu_memory_growth: bool = True,
    gpu_memory_limit_mb: int = 0,
    log_placement: bool = False,
    intra_op_threads: int = 0,
    replicas: int = 1,
) -> None:
    """Sets up devices; call before any TensorFlow op runs.

    CPU tensors come from TensorFlow's pool (`CPU_POOL_VARIABLE`) unless the
    environment sets it (`TF_CPU_ALLOCATOR_USE_BFC=false`: from glibc's malloc).

    Args:
      logical_cpus: split the first CPU into this many logical devices (0 = leave as is).
      gpu_memory_growth: allocate GPU memory as needed instead of all at start.
      gpu_memory_limit_mb: cap each GPU's memory for this process (0 = no cap).
      log_placement: log the device every op runs on.
      intra_op_threads: threads one op may use; 0 = auto (see `op_threads`).
      replicas: how many replicas this process will run, for the auto thread count.

    Raises:
      UserError: a negative count or limit.
    """
    if logical_cpus < 0:
        raise UserError(
            f"`devices.logical_cpus` ({logical_cpus}) must be >= 0 (0 leaves the CPU as is)."
        )
    if intra_op_threads < 0:
        raise UserError(f"`devices.intra_op_threads` ({intra_op_threads}) must be >= 0 (0 = auto).")
    if gpu_memory_limit_mb < 0:
        raise UserError(
            f"`devices.gpu_memory_limit_mb` ({gpu_memory_limit_mb}) must be >= 0 (0 = no cap)."
        )
    os.environ.setdefault(CPU_POOL_VARIABLE, "true")  # read once the runtime starts
    tf.debugging.set_log_device_placement(log_placement)
    try:
        _split_cpu(logical_cpus)
        _configure_gpus(gpu_memory_growth, gpu_memory_limit_mb)
        tf.config.threading.set_intra_op_parallelism_threads(op_threads(intra_op_threads, replicas))
    except RuntimeError:
        # The runtime already started (e.g. a second run in one process): devices and
        # threads are fixed.
        have = len(tf.config.list_logical_devices("CPU"))
        if logical_cpus and have != logical_cpus:
            logging.warning(
                "TensorFlow already started with %d logical CPUs; `devices.logical_cpus=%d` "
                "takes effect only in a new process.",
                have,
                logical_cpus,
            )


def op_threads(intra_op_threads: int, replicas: int) -> int:
    """The intra-op thread count to set: `intra_op_threads`, or with 0 an automatic one.

    Replicas on logical CPUs share one host's cores. With every core open to each
    op, the towers' ops contend for all of them; giving each replica its share of
    the cores lets them run side by side. With a GPU, or one replica, 0 keeps
    TensorFlow's default (every core).
    """
    if intra_op_threads or replicas <= 1 or tf.config.list_physical_devices("GPU"):
        return intra_op_threads
    return max(1, host_cores() // replicas)


def threads_per_op() -> int:
    """How many threads one op may use in this process."""
    return tf.config.threading.get_intra_op_parallelism_threads() or host_cores()


def host_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def one_per_device(options, logical_cpus: int) -> int:
    """Replicas of a plugin that runs one on each device of its `devices` option.

    Known before the runtime starts: no option ("" = every local device) counts
    `logical_cpus` (GPUs, if any, make the count moot for thread sharing).
    """
    spec = (options or {}).get("devices", "")
    return len([d for d in spec.split(",") if d.strip()]) or max(1, logical_cpus)


def _split_cpu(n: int) -> None:
    if n == 0:
        return
    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu)
    if current is not None and len(current) == n:
        return
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)


def _configure_gpus(memory_growth: bool, memory_limit_mb: int) -> None:
    for gpu in tf.config.list_physical_devices("GPU"):
        if memory_limit_mb:
            tf.config.set_logical_device_configuration(
                gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)]
            )
        elif memory_growth:
            tf.config.experimental.set_memory_growth(gpu, True)


def physical() -> list[str]:
    """Names of the physical devices (probes them without starting the runtime)."""
    return [d.name for d in tf.config.list_physical_devices()]


def gpus() -> list[str]:
    """Names of the logical GPU devices."""
    return [d.name for d in tf.config.list_logical_devices("GPU")]


def cpus() -> list[str]:
    """Names of the logical CPU devices."""
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def parse_devices(spec: str, option: str) -> list[str]:
    """A comma-separated device list from config; "" means the local accelerators.

    With no GPUs, "" means every logical CPU (see `devices.logical_cpus`).

    Raises:
      UserError: a named device that does not exist here.
    """
    known = gpus() + cpus()
    if not spec:
        return gpus() or cpus()
    names = [_canonical(d.strip(), option) for d in spec.split(",") if d.strip()]
    for name in names:
        if name not in known:
            raise UserError(
                f"`{option}` names device '{name}', which this machine does not have; "
                f"known devices: {', '.join(known)}."
            )
    return names


def _canonical(name: str, option: str) -> str:
    """'/gpu:0' -> '/device:GPU:0', matching `tf.config.list_logical_devices` names.

    Raises:
      UserError: `name` is not a device name.
    """
    try:
        spec = tf.DeviceSpec.from_string(name)
    except ValueError:
        known = ", ".join(gpus() + cpus())
        raise UserError(
            f"`{option}` holds '{name}', which is not a device name; set it to one of: {known}."
        ) from None
    if spec.job or spec.task is not None:
        return spec.to_string()
    return f"/device:{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"
