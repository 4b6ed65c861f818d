"""Named features of mixed dtypes and shapes from TFRecord and CSV files (`data.features`).

Files are written to `tmp_path`; pipelines are driven with real
`tf.distribute.InputContext`s. A CSV of numeric, integer and string columns
also trains in-process under `mirrored`, its string column looked up inside
the model (`wide_model` below, a user's builder).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from configs import default
from tests.helpers import one_line_error, tiny_config
from trainer import data
from trainer.data.features import FeatureSpec, parse_features
from trainer.loop import models, train

COUNTRIES = ["fr", "de", "jp"]


def _config(name: str, tmp_path, **fields):
    config = default.get_config().data
    config.name = name
    suffix = "tfrecord" if name == "tfrecord" else "csv"
    config.update(
        {
            "train_files": str(tmp_path / f"train.{suffix}"),
            "eval_files": str(tmp_path / f"eval.{suffix}"),
            "num_classes": 2,
            **fields,
        }
    )
    return config


def _context(pipelines: int = 1, pipeline: int = 0, replicas: int = 1):
    return tf.distribute.InputContext(pipelines, pipeline, replicas)


def _eval_batches(dataset, batch: int = 4):
    return list(dataset.eval_fn(batch)(_context()))


# --- the spec ----------------------------------------------------------------------


def test_parse_features():
    assert parse_features("age:float32,country:string,ids:int64:var,img:float32:8x8x1") == [
        FeatureSpec("age", tf.float32),
        FeatureSpec("country", tf.string),
        FeatureSpec("ids", tf.int64, (), variable=True),
        FeatureSpec("img", tf.float32, (8, 8, 1)),
    ]


@pytest.mark.parametrize(
    "text, match",
    [
        ("x", "item 'x' is not 'name:dtype"),
        ("x:float16", "item 'x:float16' is not"),
        ("x:float32:8xa", "item 'x:float32:8xa' is not"),
        ("x:float32:0", "item 'x:float32:0' is not"),
        ("x:float32:4:var", "item 'x:float32:4:var' is not"),
        ("a:int64, a:float32", "names `a` twice"),
    ],
)
def test_bad_specs_areone_line_error(text, match):
    one_line_error(match, parse_features, text)


# --- TFRecord ------------------------------------------------------------------------


def _example(age, country, ids, image, label, **more) -> bytes:
    def floats(values):
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))

    def ints(values):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))

    feature = {
        "age": floats([age]),
        "country": tf.train.Feature(bytes_list=tf.train.BytesList(value=[country.encode()])),
        "ids": ints(ids),
        "img": floats(image),
        "label": ints([label]),
        **more,
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def _records(n: int, seed: int):
    """`n` examples: age, country, 0-3 ids, a 2x2 image, a label."""
    rng = np.random.RandomState(seed)
    return [
        {
            "age": float(20 + i),
            "country": COUNTRIES[i % 3],
            "ids": list(rng.randint(1000, size=i % 4)),
            "image": list(rng.normal(size=4).astype(np.float32)),
            "label": i % 2,
        }
        for i in range(n)
    ]


def _write_tfrecord(path, records) -> None:
    with tf.io.TFRecordWriter(str(path)) as writer:
        for r in records:
            writer.write(_example(r["age"], r["country"], r["ids"], r["image"], r["label"]))


SPEC = "age:float32,country:string,ids:int64:var,img:float32:2x2"


def test_tfrecord_named_features_of_mixed_dtypes(tmp_path):
    train_records, eval_records = _records(12, seed=0), _records(6, seed=1)
    _write_tfrecord(tmp_path / "train.tfrecord", train_records)
    _write_tfrecord(tmp_path / "eval.tfrecord", eval_records)
    dataset = data.get(_config("tfrecord", tmp_path, features=SPEC))
    data.check(dataset)
    assert dataset.spec == data.DataSpec(None, 2, None, None)  # a dict: no one input shape
    features, labels = _eval_batches(dataset, batch=6)[0]
    assert set(features) == {"age", "country", "ids", "img"}
    assert features["age"].dtype == tf.float32 and features["age"].shape == (6,)
    np.testing.assert_array_equal(features["age"], [r["age"] for r in eval_records])
    assert features["country"].dtype == tf.string
    assert [c.decode() for c in features["country"].numpy()] == [r["country"] for r in eval_records]
    assert isinstance(features["ids"], tf.RaggedTensor) and features["ids"].dtype == tf.int64
    np.testing.assert_array_equal(features["ids"].row_lengths(), [0, 1, 2, 3, 0, 1])
    assert features["ids"].to_list() == [[int(i) for i in r["ids"]] for r in eval_records]
    assert features["img"].shape == (6, 2, 2)
    np.testing.assert_allclose(
        features["img"].numpy().reshape(6, 4), [r["image"] for r in eval_records]
    )
    np.testing.assert_array_equal(labels, [r["label"] for r in eval_records])
    assert labels.dtype == tf.int32
    epoch = list(dataset.train_fn(4, seed=0)(_context(replicas=2)).take(6))  # 12 examples
    assert sorted(float(a) for f, _ in epoch for a in f["age"]) == [r["age"] for r in train_records]


def test_tfrecord_one_float_feature_is_still_one_tensor(tmp_path):
    for split in ("train", "eval"):
        _write_tfrecord(tmp_path / f"{split}.tfrecord", _records(4, seed=0))
    dataset = data.get(_config("tfrecord", tmp_path, features="img:float32:4", input_shape=(2, 2)))
    assert dataset.spec.input_shape == (2, 2)
    x, _ = _eval_batches(dataset)[0]
    assert isinstance(x, tf.Tensor) and x.shape == (4, 2, 2)


def test_tfrecord_missing_feature_is_named_at_start_up(tmp_path):
    for split in ("train", "eval"):
        _write_tfrecord(tmp_path / f"{split}.tfrecord", _records(4, seed=0))
    config = _config("tfrecord", tmp_path, features="age:float32,height:float32")
    message = one_line_error("`data.features` names `height`", data.get, config)
    assert f"TFRecord file '{tmp_path / 'train.tfrecord'}' does not have" in message
    assert "its features: age, country, ids, img, label" in message
    config.features = "age:float32,ids:float32:var"
    one_line_error("reads `ids` as float32, and .* holds it as int64", data.get, config)
    config.features, config.label_dtype = "age:float32", "float32"
    one_line_error("`data.label_dtype` is float32, and .* as int64", data.get, config)
    config.features, config.label_dtype = "age:float32,label:int64", "int64"
    one_line_error("`data.features` includes `label`, the label", data.get, config)


# --- CSV -----------------------------------------------------------------------------

CSV_HEADER = "age,notes,education,zip,income"


def _write_csv(path, rows: int, offset: int = 0) -> None:
    lines = [CSV_HEADER]
    for i in range(offset, offset + rows):
        education = ["HS-grad", "Bachelors", "Masters"][i % 3]
        notes = f"free text {i}; not a number"
        lines.append(f"{20 + i},{notes},{education},{75000 + i},{(i % 3 == 2) * 1}")
    path.write_text("\n".join(lines) + "\n")


CSV_SPEC = "age:float32,education:string,zip:int64"


def _csv_files(tmp_path, train_rows: int = 24, eval_rows: int = 6) -> None:
    _write_csv(tmp_path / "train.csv", train_rows)
    _write_csv(tmp_path / "eval.csv", eval_rows, offset=100)


def test_csv_named_columns_of_mixed_dtypes(tmp_path):
    _csv_files(tmp_path)
    dataset = data.get(_config("csv", tmp_path, features=CSV_SPEC, label="income"))
    data.check(dataset)
    assert dataset.spec == data.DataSpec(None, 2, 24, 6)
    features, labels = _eval_batches(dataset, batch=6)[0]
    assert set(features) == {"age", "education", "zip"}  # `notes` is not read
    np.testing.assert_array_equal(features["age"], np.arange(120, 126, dtype=np.float32))
    assert features["zip"].dtype == tf.int64
    np.testing.assert_array_equal(features["zip"], np.arange(75100, 75106))
    assert [e.decode() for e in features["education"].numpy()] == [
        "Bachelors",
        "Masters",
        "HS-grad",
    ] * 2
    np.testing.assert_array_equal(labels, [0, 1, 0, 0, 1, 0])


def _bad_line(tmp_path, row: int, text: str):
    _csv_files(tmp_path)
    path = tmp_path / "train.csv"
    lines = path.read_text().splitlines()
    lines[row + 1] = text
    path.write_text("\n".join(lines) + "\n")
    return _config("csv", tmp_path, features=CSV_SPEC, label="income")


def test_csv_bad_values_in_numeric_columns_areone_line_error(tmp_path):
    path = tmp_path / "train.csv"
    message = one_line_error("line 6", data.get, _bad_line(tmp_path, 4, "24,x,Masters,75k,0"))
    assert message == (
        f"CSV file '{path}' line 6, column `zip` (column 4): '75k' is not an integer; "
        "fix or remove that line."
    )
    message = one_line_error("line 3", data.get, _bad_line(tmp_path, 1, "old,x,Masters,1,0"))
    assert "column `age` (column 1): 'old' is not a number" in message
    message = one_line_error("line 4", data.get, _bad_line(tmp_path, 2, "22,x,Masters"))
    assert "line 4 has 3 values, and the header 5 columns" in message


def test_csv_missing_column_or_a_shape_isone_line_error(tmp_path):
    _csv_files(tmp_path)
    config = _config("csv", tmp_path, features="age:float32,height:float32", label="income")
    message = one_line_error("`data.features` names `height`", data.get, config)
    assert "its columns: age, education, income, notes, zip" in message
    config.features = "age:float32:2"
    one_line_error("gives CSV column `age` a shape", data.get, config)


# --- reaching the model --------------------------------------------------------------


def test_a_built_in_model_of_named_features_is_one_line(tmp_path):
    _csv_files(tmp_path)
    config = tiny_config()
    spec = data.get(_config("csv", tmp_path, features=CSV_SPEC, label="income")).spec
    one_line_error("`model.name` 'mlp' takes one input tensor", models.build, config.model, spec)


def wide_model(spec, config) -> keras.Model:
    """A user's model of the CSV's named columns; the string column is looked up inside it."""
    age = keras.Input((), name="age")
    education = keras.Input((), dtype="string", name="education")
    zip_code = keras.Input((), dtype="int64", name="zip")
    lookup = keras.layers.StringLookup(
        vocabulary=["HS-grad", "Bachelors", "Masters"], output_mode="one_hot"
    )
    hashed = keras.layers.Hashing(16, output_mode="one_hot")(keras.layers.Reshape((1,))(zip_code))
    scaled = keras.layers.Reshape((1,))(age) / 100.0
    hidden = keras.layers.Concatenate()([scaled, lookup(education), hashed])
    logits = keras.layers.Dense(spec.num_classes)(hidden)
    return keras.Model({"age": age, "education": education, "zip": zip_code}, logits)


def test_named_csv_columns_train_under_mirrored(tmp_path):
    _csv_files(tmp_path, train_rows=48, eval_rows=12)
    config = tiny_config(
        **{
            "strategy.name": "mirrored",
            "model.name": "tests.test_data_features:wide_model",
            "train.global_batch_size": 8,
            "eval.global_batch_size": 8,
            "train.steps": 10,
        }
    )
    config.data.update(_config("csv", tmp_path, features=CSV_SPEC, label="income"))
    results = train.train_and_evaluate(config, str(tmp_path / "model"))
    assert results["step"] == 10
    assert results["eval"]["examples"] == 12
    assert np.isfinite(results["eval"]["loss"])
