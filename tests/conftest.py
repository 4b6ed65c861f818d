"""Test setup: split the CPU into 4 logical devices before TensorFlow starts.

Multi-replica plugins (`mirrored`, `central_storage`) then run real
multi-replica code on a CPU-only machine. No process a test starts outlives
it: the fixtures below kill what is left (see `tests.helpers.kill`).
"""

import gc
import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from towerflow.processes import native_stderr_silenced  # noqa: E402

with native_stderr_silenced():  # TensorFlow's start-up chatter, in each test worker
    from strategies import devices
    from tests import helpers

    devices.configure(logical_cpus=helpers.LOGICAL_CPUS)
# What the imports made (TensorFlow's, Keras's: lives as long as the process) out of the
# collector's sight: a full collection walks only what the tests made (0.17 s of CPU less each).
gc.freeze()


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


@pytest.fixture
def iterators_end_with_the_test():
    """A test that expects a run to fail: the run's input iterators end with the test.

    The error `pytest.raises` keeps holds the failed run's frames, and with them
    its iterators, in a reference cycle; left to a later collection, in another
    test, an old iterator's destructor may wait out tf.data's autotuning period
    (BUILD.md, "Tests").
    """
    yield
    gc.collect()


@pytest.fixture(autouse=True)
def _own_collective_keys():
    """A `MirroredStrategy` a test makes meets no collective of an earlier test's strategy."""
    from strategies import tf_patches

    tf_patches.own_collective_keys()


@pytest.fixture(autouse=True)
def _op_determinism_off_after_each_test():
    """A test that trained with `train.deterministic` leaves no refusals to the next one.

    Op determinism is process-wide (see `strategies.tf_patches.op_determinism`);
    a test that builds steps without a run would otherwise inherit it.
    """
    yield
    from strategies import tf_patches

    tf_patches.op_determinism(False)


# The longest files of the default tier first (the seconds their tests took in all, a run of
# the whole tier on the 2-core machine, 2026-12-07 18:15 UTC): pytest-xdist's `--dist loadfile`
# hands files out in collection order, so a long file collected last would run alone at the
# end while the other workers sit idle.
LONG_FILES_FIRST = (
    "test_readme.py",  # 121 s
    "test_data_service.py",  # 106
    "test_dynamic_embedding.py",  # 70
    "test_table_training.py",  # 64
    "test_follow.py",  # 61
    "test_examples.py",  # 60
    "test_slurm.py",  # 54 (waiting, mostly)
    "test_elastic.py",  # 47
    "test_progressive.py",  # 44
    "test_retrieval.py",  # 43
    "test_launch.py",  # 41
    "test_data_labels.py",  # 40
    "test_helpers.py",  # 38
    "test_pipeline.py",  # 38
)


def pytest_collection_modifyitems(items):
    """Runs the long files first, each file's tests in their own order."""
    rank = {name: place for place, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
