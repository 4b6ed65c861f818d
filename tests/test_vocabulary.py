"""Vocabulary layers inside the model train, evaluate and export under parameter servers.

`StringLookup`, `IntegerLookup` and `TextVectorization` with a fixed
vocabulary: each worker reaches its own copy of the table (a `DistributedTable`,
captured where the loop of steps can feed it), and the export, loaded in a
fresh process, serves raw strings.
"""

import json
import sys

from tests.helpers import assert_exit, run_command, train_on_cluster

SERVE = """
import sys
import tensorflow as tf
serve = tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
out = serve(
    colour=tf.constant(["blue", "red", "purple"]),
    code=tf.constant([30, 10, 99], tf.int64),
    text=tf.constant(["blue sky", "red sky", "purple sky"]),
)
print("CLASSES", out["classes"].numpy().tolist())
"""


def test_vocabulary_layers_train_and_serve_strings_under_parameter_servers(tmp_path):
    results = train_on_cluster(
        tmp_path,
        "--strategy=parameter_server",
        "--config.data.name=tests.check_models:vocabulary_dataset",
        "--config.data.num_classes=3",
        "--config.model.name=tests.check_models:vocabulary_layers",
        "--config.train.steps=60",
        "--config.train.steps_per_loop=20",
        "--config.train.global_batch_size=32",
        "--config.optimizer.learning_rate=0.05",
        "--config.optimizer.warmup_steps=0",
        "--config.eval.every=0",
    )
    assert results["step"] == 60
    assert results["eval"]["accuracy"] == 1.0, results["eval"]
    served = run_command(
        [sys.executable, "-c", SERVE, str(tmp_path / "model" / "export")], cwd=str(tmp_path)
    )
    assert_exit(served)
    line = next(x for x in served.stdout.splitlines() if x.startswith("CLASSES"))
    assert json.loads(line.split(" ", 1)[1])[:2] == [2, 0], line
