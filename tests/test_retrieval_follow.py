"""Retrieval under `data.follow`: each exported version serves the items held at its step.

A run follows CSV files of interactions (`FollowedRetrievalTask`, the
example's towers over files); a file bringing item ids never seen before
lands while it trains; the next version, loaded with `tf.saved_model.load`,
answers those raw ids for the user who chose them, and the version before
cannot.
"""

import os
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from examples import retrieval as example
from tests.helpers import REPO, TIMEOUT_S, launched
from trainer.loop import export as export_lib
from trainer.loop import train

BATCH = 16
FILE_STEPS = 4  # a file is one block of 4 steps of 16 interactions
OLD_ITEMS = list(range(1, 11))  # the first file's items
NEW_ITEMS = [1001, 1002, 1003]  # the second file's: never seen before it lands
NEW_USER = 777  # chooses the new items only


class FollowedRetrievalTask(example.RetrievalTask):
    """The example's towers, trained on the CSV files (`user_id,item_id`) it is given."""

    def dataset_fn(self, input_context, split, global_batch_size, files):
        del split
        records = tf.data.experimental.CsvDataset(files, [tf.int64, tf.int64], header=True)
        examples = records.map(
            lambda user, item: ({"user_id": user, "item_id": item}, tf.ones([], tf.float32))
        )
        return examples.batch(input_context.get_per_replica_batch_size(global_batch_size))


def _write(path, users, items) -> None:
    """A file of interactions, written under a hidden name and renamed into place whole."""
    hidden = os.path.join(os.path.dirname(path), "." + os.path.basename(path))
    with open(hidden, "w") as f:
        f.write("user_id,item_id\n")
        f.writelines(f"{u},{i}\n" for u, i in zip(users, items, strict=True))
    os.rename(hidden, path)


def _first_file(path) -> None:
    rng = np.random.default_rng(0)
    rows = FILE_STEPS * BATCH
    _write(path, rng.integers(1, 50, rows), rng.choice(OLD_ITEMS, rows))


def _second_file(path) -> None:
    """Every other row the new user choosing a new item; the others old users and items."""
    rng = np.random.default_rng(1)
    half = FILE_STEPS * BATCH // 2
    old_users, old_items = rng.integers(1, 50, half), rng.choice(OLD_ITEMS, half)
    users = np.stack([np.full(half, NEW_USER), old_users], 1).reshape(-1)
    items = np.stack([np.resize(NEW_ITEMS, half), old_items], 1).reshape(-1)
    _write(path, users, items)


OVERRIDES = {
    "task.name": "tests.test_retrieval_follow:FollowedRetrievalTask",
    "task.num_users": 100,
    "task.item_capacity": 64,
    "task.width": 8,
    "task.k": 3,
    "task.log_q": False,  # the new items are rare: log-Q would score them down in serving
    "data.follow": True,
    "data.follow_poll_secs": 0.1,
    "train.steps": 2 * FILE_STEPS,
    "train.steps_per_loop": FILE_STEPS,
    "train.checkpoint_every": FILE_STEPS,
    "train.global_batch_size": BATCH,
    "train.export": False,
    "export.every_steps": FILE_STEPS,
    "export.keep": 0,
    "optimizer.learning_rate": 0.1,
    "optimizer.schedule": "constant",
    "optimizer.warmup_steps": 0,
}


def _files(data_dir) -> dict:
    """The first file (and the eval file) written; the config's fields naming them."""
    (data_dir / "train").mkdir(parents=True)
    _first_file(data_dir / "eval.csv")
    _first_file(data_dir / "train" / "a.csv")
    return {
        "data.train_files": str(data_dir / "train" / "*.csv"),
        "data.eval_files": str(data_dir / "eval.csv"),
    }


def _land_after_a_version(export_dir, path) -> dict:
    """Lands the second file once a version is exported; returns {"before": that version}.

    The run meanwhile waits for files (`data.follow`): every step of the
    version before trained on the first file only.
    """
    seen = {}

    def land():
        deadline = time.monotonic() + TIMEOUT_S
        while not export_lib.versions(str(export_dir)) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["before"] = export_lib.versions(str(export_dir))[0]
        _second_file(path)

    seen["thread"] = threading.Thread(target=land, daemon=True)
    seen["thread"].start()
    return seen


def _top_k(version_dir, user: int) -> list[int]:
    serve = tf.saved_model.load(str(version_dir)).signatures["serving_default"]
    return serve(user_id=tf.constant([user], tf.int64))["item_ids"].numpy()[0].tolist()


def _follow_and_serve(tmp_path, train_fn) -> tuple[list[int], list[int]]:
    """The new user's top-k from the version before the second file, and from the newest.

    `train_fn(fields, model_dir)` runs the training with the config's `fields`.
    """
    fields = {**OVERRIDES, **_files(tmp_path / "data")}
    export = tmp_path / "run" / "export"
    landing = _land_after_a_version(export, tmp_path / "data" / "train" / "b.csv")
    train_fn(fields, tmp_path / "run")
    landing["thread"].join()
    newest = export_lib.versions(str(export))[-1]
    assert newest > landing["before"]
    return (_top_k(export / str(v), NEW_USER) for v in (landing["before"], newest))


def _in_process(strategy: str):
    def train_fn(fields, model_dir):
        config = example.get_config()
        config.devices.logical_cpus = 4
        config.update_from_flattened_dict({**fields, "strategy.name": strategy})
        train.train_and_evaluate(config, str(model_dir), "train")

    return train_fn


def _on_a_cluster(fields, model_dir):
    flags = [f"--config.{name}={value}" for name, value in fields.items()]
    launched(
        "--workers=2",
        "--ps=2",
        "--",
        "--strategy=parameter_server",
        f"--config={REPO}/examples/retrieval.py",
        f"--model_dir={model_dir}",
        *flags,
        cwd=model_dir.parent,
    )


def test_a_followed_file_of_new_items_is_retrieved_by_the_next_version_only(tmp_path):
    before, after = _follow_and_serve(tmp_path, _in_process("one_device"))
    assert not set(before) & set(NEW_ITEMS), before
    assert sorted(after) == NEW_ITEMS, after


@pytest.mark.slow  # a cluster of 2 workers and 2 ps: about a minute
def test_under_parameter_server_the_next_version_retrieves_a_followed_files_new_items(tmp_path):
    before, after = _follow_and_serve(tmp_path, _on_a_cluster)
    assert not set(before) & set(NEW_ITEMS), before
    assert set(after) & set(NEW_ITEMS), after
