"""Test setup: split the CPU into 4 logical devices before TensorFlow starts.

Multi-replica plugins (`mirrored`, `central_storage`) then run real
multi-replica code on a CPU-only machine.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from strategies import devices  # noqa: E402

LOGICAL_CPUS = 4
devices.configure(logical_cpus=LOGICAL_CPUS)
