"""Device setup: how many threads each op gets."""

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
