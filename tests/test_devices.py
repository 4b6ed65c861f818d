"""Device setup: how many threads each op gets, and where CPU tensors come from."""

import os

import pytest

from strategies import devices
from towerflow.errors import UserError


def test_replicas_on_logical_cpus_share_the_cores():
    cores = devices.host_cores()
    assert devices.op_threads(0, replicas=2) == max(1, cores // 2)
    assert devices.op_threads(0, replicas=cores * 4) == 1


def test_one_replica_or_a_set_count_keeps_it():
    assert devices.op_threads(0, replicas=1) == 0  # TensorFlow's default: every core
    assert devices.op_threads(3, replicas=2) == 3


def test_plugins_count_their_replicas_before_tensorflow_starts():
    import strategies

    assert strategies.local_replicas(strategies.plugin("one_device"), None, 4) == 1
    assert strategies.local_replicas(strategies.plugin("mirrored"), None, 4) == 4
    options = {"devices": "/cpu:0, /cpu:1"}
    assert strategies.local_replicas(strategies.plugin("central_storage"), options, 4) == 2


def test_negative_thread_count_is_a_user_error():
    with pytest.raises(UserError, match=r"`devices.intra_op_threads` \(-1\) must be >= 0"):
        devices.configure(intra_op_threads=-1)


def test_cpu_tensors_come_from_tensorflows_pool():
    # This process's devices were set up by `devices.configure` (tests/conftest.py): only
    # TensorFlow's pool keeps the statistics that `get_memory_info` reads.
    import tensorflow as tf

    tf.reduce_sum(tf.ones((512, 512)))  # at least one tensor of the pool's
    assert tf.config.experimental.get_memory_info("CPU:0")["peak"] >= 512 * 512 * 4


def test_an_allocator_the_environment_chose_is_kept(monkeypatch):
    monkeypatch.setenv(devices.CPU_POOL_VARIABLE, "false")
    devices.configure()  # the runtime runs already: only what it would set is checked
    assert os.environ[devices.CPU_POOL_VARIABLE] == "false"
