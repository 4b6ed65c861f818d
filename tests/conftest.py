"""Test setup: split the CPU into 4 logical devices before TensorFlow starts.

Multi-replica plugins (`mirrored`, `central_storage`) then run real
multi-replica code on a CPU-only machine. No process a test starts outlives
it: the fixtures below kill what is left (see `tests.helpers.kill`).
"""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from trainer.cli import native_stderr_silenced  # noqa: E402

LOGICAL_CPUS = 4
with native_stderr_silenced():  # TensorFlow's start-up chatter, in each test worker
    from strategies import devices
    from tests import helpers

    devices.configure(logical_cpus=LOGICAL_CPUS)


@pytest.fixture(autouse=True, scope="module")
def _no_process_outlives_its_module():
    """What a module-scoped fixture started ends with the module (set up before those)."""
    with helpers.killed_when_done():
        yield


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """Whatever a test started ends with it: passed, failed, timed out or interrupted."""
    with helpers.killed_when_done():
        yield


@pytest.fixture(autouse=True)
def _op_determinism_off_after_each_test():
    """A test that trained with `train.deterministic` leaves no refusals to the next one.

    Op determinism is process-wide (see `strategies.tf_patches.op_determinism`);
    a test that builds steps without a run would otherwise inherit it.
    """
    yield
    from strategies import tf_patches

    tf_patches.op_determinism(False)
