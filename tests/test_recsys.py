"""The ctr source's raw ids; `examples/recsys.py` as the README runs it."""

import json

import numpy as np
import pytest
import tensorflow as tf

import configs.ctr
from examples import recsys
from tests import helpers
from tests.test_models import tiny_ctr_config
from towerflow.errors import UserError
from trainer import data
from trainer.data import ctr
from trainer.loop import train

RAW = {"id_space": "raw", "zipf_a": 1.2, "ids_per_field": 1_000_000}


def _eval_examples(num_examples: int = 2000, **options) -> tuple[np.ndarray, np.ndarray]:
    """Every eval example (the last half of the indices, in order) of a raw ctr source."""
    config = configs.ctr.get_config().data
    config.eval_fraction = 0.5
    config.ctr.update({"num_examples": num_examples, **RAW, **options})
    x, y = zip(*data.get(config).eval_fn(500)(tf.distribute.InputContext()), strict=True)
    return np.concatenate([t.numpy() for t in x]), np.concatenate([t.numpy() for t in y])


def test_raw_ids_spread_over_the_64_bit_space_the_same_on_every_read():
    x, y = _eval_examples()
    again, _ = _eval_examples()
    np.testing.assert_array_equal(x, again)
    assert x.dtype == np.int64 and x.shape == (1000, 8)
    assert x.min() < -(2**62) and x.max() > 2**62 and np.all(x != 0)
    assert 0.2 < y.mean() < 0.5, "clicks are a minority, not a rarity"
    ids, counts = np.unique(x, return_counts=True)
    assert counts.max() > 100 and np.mean(counts == 1) > 0.7, "a long tail under a few common ids"


def test_a_larger_zipf_exponent_makes_the_common_ids_commoner():
    shares = []
    for a in (0.8, 1.6):
        x, _ = _eval_examples(zipf_a=a)
        shares.append(np.unique(x[:, 0], return_counts=True)[1].max() / len(x))
    assert shares[1] > 2 * shares[0], shares


def _top(column: np.ndarray, k: int = 2) -> set:
    ids, counts = np.unique(column, return_counts=True)
    return set(ids[np.argsort(-counts)[:k]].tolist())


def test_drift_brings_new_ids_to_the_top_and_lets_old_ones_fade():
    steady, _ = _eval_examples()
    assert _top(steady[:500, 0]) == _top(steady[500:, 0]), "no drift: the same popular ids"
    drifting, _ = _eval_examples(drift_every=20)
    early, late = drifting[:500, 0], drifting[500:, 0]
    assert not _top(early) & _top(late), "the popular ids of the end are new"
    assert len(np.setdiff1d(late, early)) > 0.5 * len(np.unique(late))


def test_the_list_is_padded_after_its_length_with_0_or_the_empty_string():
    x, _ = _eval_examples(multi_valued=4)
    assert x.shape == (1000, 12)
    present = x[:, 8:] != 0
    lengths = present.sum(axis=1)
    assert set(lengths.tolist()) == {1, 2, 3, 4}
    np.testing.assert_array_equal(present, np.arange(4)[None, :] < lengths[:, None])
    assert np.all(x[:, :8] != 0)
    strings, _ = _eval_examples(multi_valued=4, id_dtype="string")
    expected = np.where(x == 0, b"", np.char.encode(x.astype(str)))
    np.testing.assert_array_equal(strings, expected)


def test_clicks_follow_the_hidden_weights_of_the_ids():
    x, y = _eval_examples(num_examples=8000)
    logits = ctr.hidden_weights(tf.constant(x), 0.7).numpy().sum(axis=1)
    auc = tf.keras.metrics.AUC()
    auc.update_state(y, tf.sigmoid(logits))
    assert auc.result().numpy() > 0.75, "a table that tells ids apart can learn the clicks"


def test_the_hidden_clicks_are_the_examples_labels_and_their_probabilities():
    config = configs.ctr.get_config().data
    config.eval_fraction = 0.5
    config.ctr.update({"num_examples": 4000, **RAW, "multi_valued": 3, "drift_every": 50})
    _, y = _eval_examples(num_examples=4000, multi_valued=3, drift_every=50)
    # In a graph, as the input pipeline draws them (eagerly, one `map_fn` call an example).
    clicks = tf.function(lambda indices: ctr.hidden_clicks(config.ctr, indices))
    probabilities, labels = clicks(tf.range(2000, 4000))
    np.testing.assert_array_equal(labels.numpy(), y)
    assert abs(probabilities.numpy().mean() - y.mean()) < 0.03, "the labels are draws of them"


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"id_space": "exact"}, "`data.ctr.id_space` 'exact' is not an id space; use one of"),
        ({"zipf_a": 0.0}, "`data.ctr.zipf_a` (0.0) must be > 0"),
        ({"drift_every": -1}, "`data.ctr.drift_every` (-1) must be >= 0"),
        ({"multi_valued": -2}, "`data.ctr.multi_valued` (-2) must be >= 0"),
        ({"id_dtype": "int32"}, "`data.ctr.id_dtype` 'int32' is not an id dtype"),
        ({"id_space": "hashed", "drift_every": 10}, "`data.ctr.drift_every` (10) needs raw ids"),
        ({"id_space": "hashed", "multi_valued": 3}, "`data.ctr.multi_valued` (3) needs raw ids"),
        ({"ids_per_field": 2**41}, "`data.ctr.ids_per_field` (2199023255552) must be at most"),
    ],
)
def test_bad_raw_id_options_are_one_line_errors_before_anything_is_written(
    options, expected, tmp_path
):
    config = tiny_ctr_config()
    config.data.ctr.update({**RAW, **options})
    with pytest.raises(UserError) as info:
        train.train_and_evaluate(config, str(tmp_path / "run"))
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("embedding, dtype", [("hashed", "int64"), ("dynamic", "string")])
def test_the_ctr_model_trains_on_raw_ids_and_a_list_in_either_table(embedding, dtype, tmp_path):
    config = tiny_ctr_config(**{"strategy.name": "one_device", "train.steps": 10})
    config.data.ctr.update({**RAW, "drift_every": 10, "multi_valued": 3, "id_dtype": dtype})
    config.model.embedding = embedding
    results = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert results["step"] == 10 and 0 <= results["eval"]["auc"] <= 1
    assert ("embedding" in results.get("tables", {})) == (embedding == "dynamic")


def _tiny_recsys(**overrides) -> dict:
    """examples/recsys.py made small: its model, data kind and optimizer; few steps."""
    return {
        "data.ctr.num_examples": 4000,
        "model.capacity": 2000,
        "train.steps": 6,
        "train.steps_per_loop": 3,
        "train.checkpoint_every": 3,
        "train.global_batch_size": 64,
        "eval.global_batch_size": 256,
        **overrides,
    }


def test_the_recsys_model_looks_string_ids_and_a_padded_list_up_in_one_table():
    config = recsys.get_config()
    config.data.ctr.num_examples = 4000
    dataset = data.get(config.data)
    model = recsys.build(dataset.spec, config.model)
    x, _ = next(iter(dataset.eval_fn(32)(tf.distribute.InputContext())))
    assert x.dtype == tf.string and x.shape == (32, recsys.FIELDS + recsys.HISTORY)
    assert model(x, training=True).shape == (32, 2)
    table = model.get_layer("ids_table")
    assert (table.key_dtype, table.min_count, table.mask_id) == ("string", 2, "")
    assert int(table.table.size()) > 0, "a training call counts the ids it sees"


# Where the README trains the example: (module run, its arguments before the config's).
README_RUNS = {
    "mirrored": ("trainer", ["--strategy=mirrored"]),
    "parameter_server": (
        "trainer.launch",
        ["--workers=2", "--ps=2", "--", "--strategy=parameter_server"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("where", sorted(README_RUNS))
def test_the_readme_commands_train_the_recsys_example(where, tmp_path):
    module, leading = README_RUNS[where]
    overrides = _tiny_recsys()
    config = recsys.get_config()
    config.update_from_flattened_dict(overrides)
    model_dir = tmp_path / "run"
    helpers.assert_exit(
        helpers.run_cli(
            *leading,
            "--config=examples/recsys.py",
            f"--model_dir={model_dir}",
            *helpers.config_flags(config, tuple(overrides)),
            cwd=helpers.REPO,
            module=module,
        )
    )
    results = json.loads((model_dir / "results.json").read_text())
    assert results["step"] == 6 and (model_dir / "export" / "saved_model.pb").exists()
    parts = results["tables"]["ids_table"]["parts"]
    if where == "parameter_server":  # split by id over both ps members
        assert [part["device"] for part in parts] == [
            f"/job:ps/replica:0/task:{task}/device:CPU:0" for task in (0, 1)
        ]
    assert all(part["ids_held"] > 0 for part in parts)
