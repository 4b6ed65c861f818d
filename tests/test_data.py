"""The data layer: specs, per-replica batches, shards, determinism, resume, files, errors.

Pipelines are driven with real `tf.distribute.InputContext`s, as a strategy
would call them; files are written to `tmp_path` by the helpers at the end.
"""

import collections
import os

import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from configs import default
from tests.helpers import one_line_error
from towerflow.errors import UserError
from trainer import data

DIGITS = os.path.join(os.path.dirname(os.path.dirname(data.__file__)), "assets", "digits.npz")


def _config(name: str = "digits", **fields) -> ml_collections.ConfigDict:
    config = default.get_config().data
    config.name = name
    config.update(fields)
    return config


def _synthetic(**fields) -> ml_collections.ConfigDict:
    config = _config("synthetic")
    config.synthetic.update({"num_examples": 100, **fields})
    return config


def _context(pipelines: int = 1, pipeline: int = 0, replicas: int = 1):
    return tf.distribute.InputContext(
        num_input_pipelines=pipelines,
        input_pipeline_id=pipeline,
        num_replicas_in_sync=replicas,
    )


def _take(dataset: tf.data.Dataset, n: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    batches = dataset.take(n) if n is not None else dataset
    return [(x.numpy(), y.numpy()) for x, y in batches]


def _examples(batches) -> collections.Counter:
    """The multiset of examples in `batches`, each as (input bytes, label)."""
    return collections.Counter(
        (x.tobytes(), y.item()) for xs, ys in batches for x, y in zip(xs, ys, strict=True)
    )


def _assert_same_batches(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)


def _eval_arrays(dataset: data.Dataset) -> tuple[np.ndarray, np.ndarray]:
    batches = _take(dataset.eval_fn(256)(_context()))
    return np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])


# --- the registry and the bundled digits ---------------------------------------------


def test_names():
    assert data.names() == ["csv", "ctr", "digits", "synthetic", "tfrecord"]


def test_digits_spec_and_values():
    dataset = data.get(_config())
    assert dataset.spec == data.DataSpec((8, 8, 1), 10, 1437, 360)
    assert dataset.spec.task == "classification"
    x, y = _eval_arrays(dataset)
    assert x.shape == (360, 8, 8, 1) and x.dtype == np.float32
    assert y.shape == (360,) and y.dtype == np.int32
    assert x.min() == 0.0 and x.max() == 1.0
    assert set(y) == set(range(10))
    np.testing.assert_array_equal(x * 16, np.round(x * 16))  # pixels are counts / 16


def test_digits_splits_partition_the_bundled_images():
    dataset = data.get(_config())
    one_epoch = _take(dataset.train_fn(479, seed=0)(_context()), 3)  # 3 * 479 = 1437
    evaluation = _take(dataset.eval_fn(100)(_context()))
    with np.load(DIGITS) as arrays:
        images = arrays["images"][..., None].astype(np.float32) / 16.0
        everything = _examples([(images, arrays["labels"].astype(np.int32))])
    assert _examples(one_epoch) + _examples(evaluation) == everything


def test_digits_split_ignores_the_config_seed():
    a, b = data.get(_config()), data.get(_config())
    _assert_same_batches(_take(a.eval_fn(120)(_context())), _take(b.eval_fn(120)(_context())))


# --- batching, sharding, determinism, resume --------------------------------------


def test_train_batches_are_per_replica():
    dataset = data.get(_config())
    x, y = next(iter(dataset.train_fn(128, seed=0)(_context(replicas=4))))
    assert x.shape == (32, 8, 8, 1) and x.dtype == tf.float32
    assert y.shape == (32,) and y.dtype == tf.int32


def test_regression_labels_are_float():
    dataset = data.get(_synthetic(num_classes=0, input_shape=(4, 3)))
    assert dataset.spec.task == "regression"
    x, y = next(iter(dataset.train_fn(16, seed=0)(_context(replicas=2))))
    assert x.shape == (8, 4, 3) and y.shape == (8,) and y.dtype == tf.float32


def test_two_pipelines_get_disjoint_shards():
    dataset = data.get(_synthetic())  # 80 train and 20 eval examples, all distinct
    train, evaluation = [], []
    for pipeline in (0, 1):
        context = _context(pipelines=2, pipeline=pipeline, replicas=2)
        train.append(_examples(_take(dataset.train_fn(8, seed=0)(context), 10)))  # one epoch
        evaluation.append(_examples(_take(dataset.eval_fn(8)(context))))
    everything = _examples(_take(dataset.eval_fn(20)(_context())))
    assert len(train[0]) == len(train[1]) == 40 and not train[0] & train[1]
    assert not evaluation[0] & evaluation[1]
    assert evaluation[0] + evaluation[1] == everything
    assert not (train[0] + train[1]) & everything


@pytest.mark.parametrize("config", [_config(), _synthetic()], ids=["digits", "synthetic"])
def test_same_seed_same_batches(config):
    dataset = data.get(config)

    def first(seed: int):
        return _take(dataset.train_fn(64, seed)(_context(replicas=2)), 5)

    _assert_same_batches(first(3), first(3))
    assert not np.array_equal(first(3)[0][0], first(4)[0][0])


@pytest.mark.parametrize("config", [_config(), _synthetic()], ids=["digits", "synthetic"])
@pytest.mark.parametrize("replicas", [1, 4])
def test_start_step_resumes_the_stream(config, replicas):
    dataset = data.get(config)
    context = _context(replicas=replicas)
    steps = 7  # with 64 per step, well past the first epoch of either dataset
    fresh = _take(dataset.train_fn(64, seed=5)(context), (steps + 3) * replicas)
    resumed = _take(dataset.train_fn(64, seed=5, start_step=steps)(context), 3 * replicas)
    _assert_same_batches(resumed, fresh[steps * replicas :])


def test_every_epoch_is_a_new_permutation():
    dataset = data.get(_synthetic())  # 80 train examples: one epoch is 10 batches of 8
    batches = _take(dataset.train_fn(8, seed=0)(_context()), 20)
    first, second = batches[:10], batches[10:]
    assert _examples(first) == _examples(second)
    assert not np.array_equal(first[0][0], second[0][0])


@pytest.mark.parametrize(
    "global_batch, pipelines, replicas", [(256, 1, 4), (255, 1, 3), (64, 2, 2), (7, 1, 1)]
)
def test_eval_counts_every_example_once(global_batch, pipelines, replicas):
    dataset = data.get(_config())
    counted = collections.Counter()
    sizes = []
    for pipeline in range(pipelines):
        context = _context(pipelines, pipeline, replicas)
        batches = _take(dataset.eval_fn(global_batch)(context))
        sizes += [len(y) for _, y in batches]
        counted += _examples(batches)
    assert sum(sizes) == 360
    assert max(sizes) == global_batch // replicas
    assert counted == _examples(_take(dataset.eval_fn(360)(_context())))


# --- synthetic data is learnable ------------------------------------------------------


def _least_squares_fit(x: np.ndarray, targets: np.ndarray):
    inputs = np.c_[x.reshape(len(x), -1), np.ones(len(x))]
    weights, *_ = np.linalg.lstsq(inputs, targets, rcond=None)
    return lambda z: np.c_[z.reshape(len(z), -1), np.ones(len(z))] @ weights


def _splits(dataset: data.Dataset):
    train = _take(dataset.train_fn(dataset.spec.train_size, seed=0)(_context()), 1)
    return train[0], _eval_arrays(dataset)


def test_synthetic_classes_are_learnable():
    dataset = data.get(_synthetic(num_examples=3000, input_shape=(32,), num_classes=10))
    (x, y), (eval_x, eval_y) = _splits(dataset)
    predict = _least_squares_fit(x, np.eye(10)[y])
    accuracy = np.mean(predict(eval_x).argmax(axis=1) == eval_y)
    assert accuracy > 0.6, f"a linear probe reaches only {accuracy:.2f}; chance is 0.10"
    assert np.bincount(y, minlength=10).min() > 0.03 * len(y), "every class is common"


def test_synthetic_regression_is_learnable():
    dataset = data.get(_synthetic(num_examples=2000, input_shape=(4, 4), num_classes=0))
    (x, y), (eval_x, eval_y) = _splits(dataset)
    predict = _least_squares_fit(x, y)
    r2 = 1 - np.mean((predict(eval_x) - eval_y) ** 2) / np.var(eval_y)
    assert r2 > 0.9


def test_synthetic_inputs_have_unit_variance_for_large_shapes():
    dataset = data.get(_synthetic(num_examples=64, input_shape=(32, 32, 3), num_classes=100))
    x, y = _eval_arrays(dataset)
    assert x.shape == (13, 32, 32, 3)
    assert abs(x.mean()) < 0.05 and abs(x.var() - 1) < 0.05
    assert len(set(y)) > 5


# --- files -------------------------------------------------------------------------


def _arrays(n: int, seed: int, classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    return rng.normal(size=(n, 64)).astype(np.float32), rng.randint(classes, size=n)


def _write_tfrecords(path_format: str, x: np.ndarray, y: np.ndarray, files: int) -> None:
    """Writes `(x, y)` round-robin over `files` files named `path_format.format(i)`."""
    for i in range(files):
        with tf.io.TFRecordWriter(path_format.format(i)) as writer:
            for features, label in zip(x[i::files], y[i::files], strict=True):
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "x": tf.train.Feature(float_list=tf.train.FloatList(value=features)),
                            "label": _label_feature(label),
                        }
                    )
                )
                writer.write(example.SerializeToString())


def _label_feature(label) -> tf.train.Feature:
    if isinstance(label, np.floating):
        return tf.train.Feature(float_list=tf.train.FloatList(value=[label]))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))


def _write_csv(path: str, x: np.ndarray, y: np.ndarray, label_at: int = 0) -> None:
    columns = [f"f{i}" for i in range(x.shape[1])]
    columns.insert(label_at, "label")
    table = np.insert(x.astype(np.float64), label_at, y, axis=1)
    np.savetxt(path, table, delimiter=",", header=",".join(columns), comments="", fmt="%.9g")


def _tfrecord_config(tmp_path, train_files: int = 3, eval_files: int = 1, **fields):
    x, y = _arrays(60, seed=0)
    eval_x, eval_y = _arrays(20, seed=1)
    _write_tfrecords(str(tmp_path / "train-{}.tfrecord"), x, y, train_files)
    _write_tfrecords(str(tmp_path / "eval-{}.tfrecord"), eval_x, eval_y, eval_files)
    config = _config(
        "tfrecord",
        train_files=str(tmp_path / "train-*.tfrecord"),
        eval_files=str(tmp_path / "eval-*.tfrecord"),
        features="x:float32:64",
        input_shape=(8, 8, 1),
        **fields,
    )
    return config, (x, y), (eval_x, eval_y)


def _as_batches(x: np.ndarray, y: np.ndarray, shape: tuple[int, ...]):
    return [(x.reshape(-1, *shape), y.astype(np.int32))]


def test_tfrecord_round_trip(tmp_path):
    config, (x, y), (eval_x, eval_y) = _tfrecord_config(tmp_path)
    dataset = data.get(config)
    data.check(dataset)
    assert dataset.spec == data.DataSpec((8, 8, 1), 10, None, None)
    got_x, got_y = _eval_arrays(dataset)  # one eval file: its order
    np.testing.assert_array_equal(got_x, eval_x.reshape(-1, 8, 8, 1))
    np.testing.assert_array_equal(got_y, eval_y)
    one_epoch = _take(dataset.train_fn(12, seed=0)(_context(replicas=2)), 10)  # 60 examples
    assert _examples(one_epoch) == _examples(_as_batches(x, y, (8, 8, 1)))


def test_tfrecord_regression_labels(tmp_path):
    x, _ = _arrays(10, seed=0)
    y = np.linspace(-1, 1, 10).astype(np.float32)
    for split in ("train", "eval"):
        _write_tfrecords(str(tmp_path / (split + "-{}.tfrecord")), x, y, files=1)
    config = _config(
        "tfrecord",
        train_files=str(tmp_path / "train-*"),
        eval_files=str(tmp_path / "eval-*"),
        label_dtype="float32",
        num_classes=0,
    )
    got_x, got_y = _eval_arrays(data.get(config))
    assert got_y.dtype == np.float32
    np.testing.assert_allclose(got_y, y)
    np.testing.assert_array_equal(got_x, x)


@pytest.mark.parametrize(
    "eval_files,sharding",
    [(3, "auto"), (1, "auto"), (2, "file"), (2, "data")],
    ids=["by_file", "by_record", "file", "data"],
)
def test_tfrecord_shards_are_disjoint(tmp_path, eval_files, sharding):
    config, _, (eval_x, eval_y) = _tfrecord_config(
        tmp_path, eval_files=eval_files, sharding=sharding
    )
    dataset = data.get(config)
    shards = [
        _examples(_take(dataset.eval_fn(4)(_context(2, pipeline, replicas=2))))
        for pipeline in (0, 1)
    ]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    assert shards[0] + shards[1] == _examples(_as_batches(eval_x, eval_y, (8, 8, 1)))


def test_sharding_off_gives_every_pipeline_all_the_data(tmp_path):
    config, _, (eval_x, eval_y) = _tfrecord_config(tmp_path, eval_files=2, sharding="off")
    dataset = data.get(config)
    everything = _examples(_as_batches(eval_x, eval_y, (8, 8, 1)))
    for pipeline in (0, 1):
        assert _examples(_take(dataset.eval_fn(4)(_context(2, pipeline, replicas=2)))) == (
            everything
        )
    digits = data.get(_config(sharding="off"))
    first = [_take(digits.train_fn(8, seed=0)(_context(2, p, replicas=2)), 2) for p in (0, 1)]
    _assert_same_batches(*first)


def test_sharding_file_needs_a_file_per_pipeline(tmp_path):
    config, _, _ = _tfrecord_config(tmp_path, eval_files=1, sharding="file")
    dataset = data.get(config)
    with pytest.raises(UserError, match="one file per input pipeline"):
        dataset.eval_fn(4)(_context(2, 0, replicas=2))
    with pytest.raises(UserError, match="Unknown `data.sharding` 'rows'"):
        data.get(_config(sharding="rows"))


def test_tfrecord_stream_is_deterministic_and_resumes(tmp_path):
    config, _, _ = _tfrecord_config(tmp_path, shuffle_buffer=16)
    dataset = data.get(config)
    context = _context(replicas=2)
    fresh = _take(dataset.train_fn(8, seed=1)(context), 30)  # 2 per step, 2 epochs
    _assert_same_batches(fresh, _take(dataset.train_fn(8, seed=1)(context), 30))
    _assert_same_batches(
        fresh[2 * 11 :], _take(dataset.train_fn(8, seed=1, start_step=11)(context), 8)
    )
    assert not np.array_equal(fresh[0][0], _take(dataset.train_fn(8, seed=2)(context), 1)[0][0])


def test_csv_round_trip(tmp_path):
    # 6 feature columns: each column is traced into the pipeline, and 64 add nothing but time.
    x, y = _arrays(30, seed=0)
    eval_x, eval_y = _arrays(9, seed=1)
    x, eval_x = x[:, :6], eval_x[:, :6]
    _write_csv(str(tmp_path / "train-0.csv"), x[:20], y[:20], label_at=5)
    _write_csv(str(tmp_path / "train-1.csv"), x[20:], y[20:], label_at=5)
    _write_csv(str(tmp_path / "eval.csv"), eval_x, eval_y, label_at=5)
    config = _config(
        "csv",
        train_files=str(tmp_path / "train-*.csv"),
        eval_files=str(tmp_path / "eval.csv"),
        input_shape=(2, 3),
    )
    dataset = data.get(config)
    data.check(dataset)
    assert (dataset.spec.train_size, dataset.spec.eval_size) == (30, 9)
    got_x, got_y = _eval_arrays(dataset)
    np.testing.assert_allclose(got_x, eval_x.reshape(-1, 2, 3), rtol=1e-6)
    np.testing.assert_array_equal(got_y, eval_y)
    one_epoch = _take(dataset.train_fn(10, seed=0)(_context()), 3)
    assert sorted(np.concatenate([y for _, y in one_epoch])) == sorted(y)


# --- errors ------------------------------------------------------------------------


def test_unknown_name():
    message = one_line_error("Unknown dataset `data.name` 'digts'", data.get, _config("digts"))
    assert "known: csv, ctr, digits, synthetic, tfrecord, or your own as 'module.path:name'" in (
        message
    )


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5])
def test_eval_fraction_must_be_a_fraction(fraction):
    message = one_line_error(r"`data.eval_fraction` \(", data.get, _config(eval_fraction=fraction))
    assert f"({fraction})" in message and "between 0 and 1" in message


def test_synthetic_errors():
    one_line_error("leaves none for training", data.get, _synthetic(num_examples=1))
    one_line_error(
        r"`data.synthetic.num_classes` \(1\) must be 0", data.get, _synthetic(num_classes=1)
    )
    one_line_error(
        r"`data.synthetic.input_shape` \(\(4, 0\)\)", data.get, _synthetic(input_shape=(4, 0))
    )
    one_line_error(r"`data.synthetic.noise` \(-1", data.get, _synthetic(noise=-1.0))


def test_empty_glob(tmp_path):
    config = _config("tfrecord", train_files=str(tmp_path / "nothing-*.tfrecord"), eval_files="x")
    message = one_line_error("No files match `data.train_files`", data.get, config)
    assert str(tmp_path / "nothing-*.tfrecord") in message and "TFRecord" in message
    one_line_error("`data.train_files` is empty", data.get, _config("csv"))


def test_csv_wrong_column_count(tmp_path):
    x, y = _arrays(5, seed=0)
    _write_csv(str(tmp_path / "a.csv"), x[:, :63], y)
    config = _config("csv", train_files=str(tmp_path / "a.csv"), eval_files=str(tmp_path / "a.csv"))
    message = one_line_error("has 63 feature columns", data.get, config)
    assert "`data.input_shape` (64,) needs 64" in message


def _csv_with_a_bad_line(tmp_path, monkeypatch, row: int, text: str) -> ml_collections.ConfigDict:
    """Two train files of 150 rows; row `row` of the second (0-based) replaced by `text`."""
    monkeypatch.setattr(data.csv, "_CSV_LINES_AT_ONCE", 64)  # the bad line is in a later chunk
    x, y = _arrays(300, seed=0)
    _write_csv(str(tmp_path / "train-0.csv"), x[:150], y[:150])
    path = tmp_path / "train-1.csv"
    _write_csv(str(path), x[150:], y[150:])
    lines = path.read_text().splitlines()
    lines[row + 1] = text
    path.write_text("\n".join(lines) + "\n")
    return _config("csv", train_files=str(tmp_path / "train-*.csv"), eval_files=str(path))


def test_csv_bad_value_names_file_line_column_and_value(tmp_path, monkeypatch):
    line = "3," + ",".join(["0.5"] * 6) + ",abc" + ",0.25" * 57
    config = _csv_with_a_bad_line(tmp_path, monkeypatch, 130, line)
    message = one_line_error("line 132", data.get, config)
    assert message == (
        f"CSV file '{tmp_path / 'train-1.csv'}' line 132, column `f6` (column 8): "
        "'abc' is not a number; fix or remove that line."
    )


def test_csv_short_line_names_file_and_line(tmp_path, monkeypatch):
    config = _csv_with_a_bad_line(tmp_path, monkeypatch, 99, "1,2,3")
    message = one_line_error("line 101 has 3 values", data.get, config)
    assert message == (
        f"CSV file '{tmp_path / 'train-1.csv'}' line 101 has 3 values, and the header "
        "65 columns; fix or remove that line."
    )


def test_csv_missing_label_column(tmp_path):
    x, y = _arrays(5, seed=0)
    _write_csv(str(tmp_path / "a.csv"), x, y)
    path = str(tmp_path / "a.csv")
    config = _config("csv", train_files=path, eval_files=path, label="digit")
    message = one_line_error("`data.label` 'digit' is not a column", data.get, config)
    assert "its columns: label, f0, f1, f2" in message and "(65 in all)" in message


def test_tfrecord_feature_mismatch_is_caught_by_check(tmp_path):
    config, _, _ = _tfrecord_config(tmp_path)
    config.features, config.input_shape = "x:float32:32", (32,)  # the files hold 64 floats
    dataset = data.get(config)
    message = one_line_error("Cannot read `data.train_files`", data.check, dataset)
    assert str(tmp_path / "train-*.tfrecord") in message
    assert "'x:float32:32'" in message


def test_tfrecord_spec_errors(tmp_path):
    config, _, _ = _tfrecord_config(tmp_path)
    config.features = "x:float:64"
    one_line_error("`data.features` item 'x:float:64' is not 'name:dtype", data.get, config)
    config.features, config.input_shape = "x:float32:8x8", (8, 9)
    one_line_error("holds 64 values but `data.input_shape` .8, 9. needs 72", data.get, config)


def test_empty_files_are_caught_by_check(tmp_path):
    config, _, _ = _tfrecord_config(tmp_path)
    with tf.io.TFRecordWriter(str(tmp_path / "empty.tfrecord")):
        pass
    config.eval_files = str(tmp_path / "empty.tfrecord")
    one_line_error("`data.eval_files` .* holds no examples", data.check, data.get(config))


def _autotune(config) -> list[tuple[bool, int | None]]:
    """Both pipelines' (autotune enabled, RAM budget) under `config`."""
    dataset = data.get(config)
    pipelines = (dataset.train_fn(8, seed=0), dataset.eval_fn(8))
    autotune = [p(_context()).options().autotune for p in pipelines]
    return [(a.enabled, a.ram_budget) for a in autotune]


def test_autotune_is_off_unless_asked_for_and_a_ram_budget_turns_it_on():
    config = _synthetic()
    assert _autotune(config) == [(False, None)] * 2
    config.autotune = True
    assert _autotune(config) == [(True, None)] * 2
    config.autotune = False
    config.autotune_ram_budget_mb = 64
    assert _autotune(config) == [(True, 64 << 20)] * 2
    config.autotune_ram_budget_mb = -1
    one_line_error(r"`data.autotune_ram_budget_mb` \(-1\) must be >= 0", data.get, config)


def test_a_pipelines_own_autotune_choice_stands():
    own = tf.data.Options()
    own.autotune.enabled = True
    pipeline = tf.data.Dataset.range(4).with_options(own)
    assert data.base.Settings().apply(pipeline).options().autotune.enabled
