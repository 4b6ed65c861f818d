"""Imported by the tests' fork server (`tests.helpers`): AutoGraph's conversions made once.

Every trainer a test forks converted the loops of `strategies` again in its
first steps, about 0.6 s of CPU each; converted here, before the server forks
anything, they are in every forked process already
(`strategies.tf_patches.converted_ahead`).
"""

from strategies import tf_patches

tf_patches.converted_ahead()
