"""Labels and values as users have them: class names, missing values, the class count.

CSV and TFRecord files written by the tests: a label of class names
(`data.label_vocabulary`, given or `auto`), missing values (`data.na_values`,
defaults in `data.features`, `data.incomplete`), each mistake one line naming
file, line and value. A model compiled with its own loss (one sigmoid unit,
`binary_crossentropy`) fed by the user's own `dataset_fn` trains without
`data.num_classes`; an uncompiled one names `data.num_classes` in its error.
"""

import json
import pathlib
import re
import shlex
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from configs import default
from tests.helpers import (
    REPO,
    assert_exit,
    one_line_error,
    run_cli,
    run_command,
    tiny_config,
    train_on_cluster,
)
from trainer import data
from trainer.data import service_client
from trainer.loop import models, train


def binary(input_context, split, global_batch_size):
    """A user's pipeline of two classes, as float labels for `binary_crossentropy`."""
    batch = input_context.get_per_replica_batch_size(global_batch_size)
    x = tf.random.stateless_uniform([64, 3], seed=[3, 4])
    y = tf.cast(x[:, 0] + x[:, 1] > 1.0, tf.float32)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    examples = examples.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
    return examples.batch(batch, drop_remainder=split == "train")


def sigmoid_model(spec, config, compile=True):
    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(inputs))
    if compile:
        model.compile(loss="binary_crossentropy", metrics=["binary_accuracy"])
    return model


def uncompiled_sigmoid_model(spec, config):
    return sigmoid_model(spec, config, compile=False)


def test_a_compiled_one_unit_sigmoid_model_trains_without_data_num_classes(tmp_path):
    config = tiny_config(
        **{
            "strategy.name": "one_device",
            "data.name": "tests.test_data_labels:binary",
            "model.name": "tests.test_data_labels:sigmoid_model",
            "train.global_batch_size": 16,
            "eval.global_batch_size": 16,
            "train.steps": 10,
            "train.export": True,
        }
    )
    assert config.data.num_classes == 10  # the digits default, which says nothing here
    results = train.train_and_evaluate(config, str(tmp_path / "model"))
    assert results["step"] == 10 and results["eval"]["examples"] == 64
    assert 0.0 <= results["eval"]["binary_accuracy"] <= 1.0
    serve = tf.saved_model.load(str(tmp_path / "model" / "export")).signatures["serving_default"]
    probability = serve(inputs=tf.constant([[0.9, 0.9, 0.0]]))["outputs"].numpy()
    assert probability.shape == (1, 1) and 0.0 < float(probability[0, 0]) < 1.0


def test_an_uncompiled_sigmoid_model_names_data_num_classes():
    config = tiny_config(**{"model.name": "tests.test_data_labels:uncompiled_sigmoid_model"})
    spec = data.DataSpec((3,), 10, None, None)
    message = one_line_error("`data.num_classes`", models.build, config.model, spec)
    assert "`--config.data.num_classes=2`" in message
    model = models.build(config.model, data.DataSpec((3,), 2, None, None))
    assert np.prod(model.outputs[0].shape[1:]) == 1


# --- CSV: class names as labels, missing values ------------------------------------------

HEADER = "size,colour,weight,species"


def _csv(tmp_path, train: list[str], evaluation: list[str] | None = None, **fields):
    """CSV files of `size` (float), `colour` (string), `weight` (int) and `species` (names)."""
    for split, lines in (("train", train), ("eval", evaluation or train)):
        (tmp_path / f"{split}.csv").write_text("\n".join([HEADER, *lines]) + "\n")
    return _data_config(tmp_path, "csv", "size:float32,colour:string,weight:int64", fields)


def _data_config(tmp_path, source: str, features: str, fields: dict):
    """The data config reading `train.<source>` and `eval.<source>`, labels `species` by name."""
    config = default.get_config().data
    config.update(
        {
            "name": source,
            "train_files": str(tmp_path / f"train.{source}"),
            "eval_files": str(tmp_path / f"eval.{source}"),
            "label": "species",
            "features": features,
            "label_vocabulary": "auto",
            **fields,
        }
    )
    return config


ROWS = ["1.5,red,3,Gentoo", "0.5,blue,1,Adelie", "2.5,red,4,Chinstrap", "1.0,blue,2,Adelie"]


def _eval(dataset) -> tuple[dict, np.ndarray]:
    features, labels = next(iter(dataset.eval_fn(64)(tf.distribute.InputContext())))
    return features, labels.numpy()


def test_a_string_label_column_becomes_classes_by_its_sorted_names(tmp_path):
    dataset = data.get(_csv(tmp_path, ROWS))
    assert dataset.spec.class_names == ("Adelie", "Chinstrap", "Gentoo")
    assert dataset.spec.num_classes == 3 and dataset.spec.train_size == 4
    _, labels = _eval(dataset)
    np.testing.assert_array_equal(labels, [2, 0, 1, 0])


def test_a_given_vocabulary_sets_the_class_order(tmp_path):
    dataset = data.get(_csv(tmp_path, ROWS, label_vocabulary="Gentoo, Adelie,Chinstrap,Emperor"))
    assert dataset.spec.class_names == ("Gentoo", "Adelie", "Chinstrap", "Emperor")
    assert dataset.spec.num_classes == 4
    np.testing.assert_array_equal(_eval(dataset)[1], [0, 1, 2, 1])


def test_a_label_not_in_the_vocabulary_is_one_line_naming_file_line_and_value(tmp_path):
    config = _csv(
        tmp_path, ROWS, ROWS + ["1.0,red,2,Emperor"], label_vocabulary="Adelie,Chinstrap,Gentoo"
    )
    message = one_line_error("Emperor", data.get, config)
    assert message == (
        f"CSV file '{tmp_path / 'eval.csv'}' line 6: the label 'Emperor' is not in "
        "`data.label_vocabulary` (Adelie, Chinstrap, Gentoo); add it to the vocabulary (or use "
        "`auto`), or fix that value."
    )


def test_a_string_label_without_a_vocabulary_points_at_the_vocabulary(tmp_path):
    config = _csv(tmp_path, ROWS, label_vocabulary="")
    message = one_line_error("line 2, column `species`", data.get, config)
    assert "'Gentoo' is not a number" in message
    assert "`--config.data.label_vocabulary=auto`" in message


def test_a_missing_value_without_a_default_is_one_line_naming_the_option(tmp_path):
    config = _csv(tmp_path, [*ROWS[:2], "NA,red,4,Chinstrap", *ROWS[3:]])
    message = one_line_error("line 4", data.get, config)
    assert message == (
        f"CSV file '{tmp_path / 'train.csv'}' line 4, column `size` is missing "
        "(`data.na_values`); give `size` a default in `data.features` (e.g. 'size:float32=0'), "
        "or set `--config.data.incomplete=drop` to leave such rows out."
    )
    config = _csv(tmp_path, [*ROWS, "1.0,red,2,"])
    assert "line 6, column `species` is missing" in one_line_error("species", data.get, config)


def test_missing_values_take_their_defaults(tmp_path):
    rows = ["N/A,,3,Gentoo", " NA ,blue,null,Adelie", "?,red,4,Chinstrap"]
    config = _csv(
        tmp_path,
        rows,
        features="size:float32=-1,colour:string=unknown,weight:int64=0",
        na_values="NA,N/A,null,?",
    )
    features, labels = _eval(data.get(config))
    np.testing.assert_array_equal(features["size"], [-1.0, -1.0, -1.0])
    assert [c.decode() for c in features["colour"].numpy()] == ["unknown", "blue", "red"]
    np.testing.assert_array_equal(features["weight"], [3, 0, 4])
    np.testing.assert_array_equal(labels, [2, 0, 1])


def test_incomplete_rows_are_dropped_and_counted(tmp_path):
    rows = [*ROWS, "NA,red,2,Gentoo", "1.0,,2,Adelie", "1.0,red,2,NA"]
    dataset = data.get(_csv(tmp_path, rows, ROWS, incomplete="drop"))
    assert dataset.spec.train_size == 4 and dataset.spec.eval_size == 4
    assert dataset.notes == (
        "data: dropped 3 of 7 rows of `data.train_files` with a missing value and no default "
        "(`data.incomplete=drop`)",
    )
    train = dataset.train_fn(4, seed=0)(tf.distribute.InputContext())
    features, labels = next(iter(train))
    assert sorted(features["size"].numpy().tolist()) == [0.5, 1.0, 1.5, 2.5]


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"incomplete": "skip"}, "Unknown `data.incomplete` 'skip'; known: error, drop"),
        ({"features": "size:float32=small"}, "gives `size` .float32. the default 'small'"),
        ({"label_vocabulary": "Adelie,Adelie"}, "names Adelie twice"),
        ({"label_vocabulary": "Adelie"}, "has not two names"),
    ],
)
def test_bad_missing_value_and_vocabulary_options_are_one_line(tmp_path, fields, match):
    one_line_error(match, data.get, _csv(tmp_path, ROWS, **fields))


# --- TFRecord: a string label, examples that lack a feature ---------------------------------


def _tfrecord(tmp_path, examples: list[dict], **fields):
    """TFRecord files of `examples` ({"size": [..], "species": [..]}), both splits the same."""
    for split in ("train", "eval"):
        with tf.io.TFRecordWriter(str(tmp_path / f"{split}.tfrecord")) as writer:
            for example in examples:
                feature = {}
                for name, values in example.items():
                    if isinstance(values[0], str):
                        values = tf.train.BytesList(value=[v.encode() for v in values])
                        feature[name] = tf.train.Feature(bytes_list=values)
                    else:
                        feature[name] = tf.train.Feature(
                            float_list=tf.train.FloatList(value=values)
                        )
                proto = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(proto.SerializeToString())
    return _data_config(tmp_path, "tfrecord", "size:float32", fields)


PENGUINS = [
    {"size": [1.5], "species": ["Gentoo"]},
    {"size": [0.5], "species": ["Adelie"]},
    {"size": [2.5], "species": ["Chinstrap"]},
]


def test_a_tfrecord_string_label_becomes_classes(tmp_path):
    dataset = data.get(_tfrecord(tmp_path, PENGUINS))
    data.check(dataset)
    assert dataset.spec.class_names == ("Adelie", "Chinstrap", "Gentoo")
    np.testing.assert_array_equal(_eval(dataset)[1], [2, 0, 1])
    config = _tfrecord(tmp_path, PENGUINS, label_vocabulary="Adelie,Gentoo")
    message = one_line_error("Chinstrap", data.get, config)
    assert (
        f"TFRecord file '{tmp_path / 'train.tfrecord'}' record 3: the label 'Chinstrap'" in message
    )


def test_a_tfrecord_example_that_lacks_a_feature_is_named_filled_or_dropped(tmp_path):
    examples = [*PENGUINS, {"species": ["Adelie"]}]
    message = one_line_error("record 4 lacks `size`", data.get, _tfrecord(tmp_path, examples))
    assert "'size:float32=0'" in message and "`--config.data.incomplete=drop`" in message
    features, labels = _eval(data.get(_tfrecord(tmp_path, examples, features="size:float32=-1")))
    np.testing.assert_array_equal(features["size"], [1.5, 0.5, 2.5, -1.0])
    dataset = data.get(_tfrecord(tmp_path, examples, incomplete="drop"))
    assert "dropped 1 of 4 examples of `data.train_files`" in dataset.notes[0]
    np.testing.assert_array_equal(_eval(dataset)[1], [2, 0, 1])


# --- the README's penguins command, as written and on a cluster ------------------------------


def _penguins_commands() -> list[list[str]]:
    """The penguins commands of docs/your-job.md, as a user would type them."""
    text = pathlib.Path(REPO, "docs", "your-job.md").read_text()
    block = next(b for b in re.findall(r"```sh\n(.*?)```", text, re.DOTALL) if "penguins" in b)
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line]


@pytest.fixture(scope="module")
def penguins_written(tmp_path_factory) -> tuple[pathlib.Path, list[str]]:
    """The data, written once as the README's first command does; the trainer's flags."""
    write, train = _penguins_commands()
    assert write[:3] == ["python", "-m", "examples.penguins"]
    directory = tmp_path_factory.mktemp("penguins")
    result = run_command([sys.executable, *write[1:]], cwd=str(directory))
    assert_exit(result)
    assert train[0] == "towerflow"
    return directory / write[3], [flag for flag in train[1:] if not flag.startswith("--model_dir")]


@pytest.fixture
def penguins(penguins_written, tmp_path) -> list[str]:
    """The README's trainer flags, run from `tmp_path`: its data directory is the one written."""
    written, flags = penguins_written
    (tmp_path / written.name).symlink_to(written)
    return flags


def _check_penguins(model_dir: pathlib.Path, results: dict) -> None:
    names = ["Adelie", "Chinstrap", "Gentoo"]
    assert results["class_names"] == names
    assert results["eval"]["accuracy"] >= 0.9, results["eval"]
    assert results["eval"]["examples"] == 78  # 2 of the 80 eval rows lack measurements
    assert {f"accuracy/{name}" for name in names} <= set(results["eval"])
    assert {f"accuracy/{name}" for name in names} <= _tensorboard_tags(model_dir / "eval")
    recorded = json.loads((model_dir / "config.json").read_text())["data"]
    assert recorded["label_vocabulary"] == ",".join(names)  # `auto`, as start-up found it
    serve = tf.saved_model.load(str(model_dir / "export")).signatures["serving_default"]
    outputs = serve(
        bill_length_mm=tf.constant([38.8, 48.8, 47.5]),
        bill_depth_mm=tf.constant([18.3, 18.4, 15.0]),
        flipper_length_mm=tf.constant([190.0, 196.0, 217.0]),
        body_mass_g=tf.constant([3700.0, 3730.0, 5080.0]),
        island=tf.constant(["Torgersen", "Dream", "Biscoe"]),
        sex=tf.constant(["male", "female", "unknown"]),
    )
    assert [n.decode() for n in outputs["class_names"].numpy()] == names
    np.testing.assert_array_equal(outputs["classes"], [0, 1, 2])


def _tensorboard_tags(logdir: pathlib.Path) -> set[str]:
    """The tags of the scalars TensorBoard shows for `logdir`."""
    return {
        value.tag
        for path in logdir.glob("events.out.tfevents.*")
        for event in tf.compat.v1.train.summary_iterator(str(path))
        for value in event.summary.value
    }


def test_the_readme_penguins_command_trains_to_090(penguins, tmp_path):
    """As written: under the default strategy (mirrored), every replica given a share."""
    model_dir = tmp_path / "model"
    result = run_cli(*penguins, f"--model_dir={model_dir}", cwd=str(tmp_path))
    assert_exit(result)
    assert "data: dropped 3 of 280 rows of `data.train_files`" in result.stdout
    _check_penguins(model_dir, json.loads((model_dir / "results.json").read_text()))


def test_the_readme_penguins_command_trains_to_090_on_a_parameter_server_cluster(
    penguins, tmp_path
):
    """One worker: the cluster's own path (variables on the ps, steps the chief schedules)."""
    results = train_on_cluster(tmp_path, *penguins, "--strategy=parameter_server", workers=1)
    _check_penguins(tmp_path / "model", results)


def test_a_vocabulary_for_a_numeric_tfrecord_label_is_one_line(tmp_path):
    examples = [{"size": [1.0], "species": [0.0]}, {"size": [2.0], "species": [1.0]}]
    message = one_line_error(
        "reads `data.label` 'species' as class names", data.get, _tfrecord(tmp_path, examples)
    )
    assert "holds it as float32" in message and "`--config.data.label_vocabulary=`" in message


def test_resuming_with_other_class_names_is_one_line(tmp_path):
    config = tiny_config(
        **{
            "strategy.name": "one_device",  # a refusal at start-up, under any strategy
            "model.name": "tests.test_data_labels:size_model",
            "train.global_batch_size": 4,
            "eval.global_batch_size": 4,
            "train.steps": 2,
        }
    )
    config.data.update(_csv(tmp_path, ROWS, features="size:float32"))
    model_dir = str(tmp_path / "model")
    train.train_and_evaluate(config, model_dir)
    _csv(tmp_path, [*ROWS, "1.0,red,2,Emperor"])  # `auto` now finds a fourth class
    message = one_line_error(
        "was trained with the classes", train.train_and_evaluate, config, model_dir
    )
    assert "Adelie,Chinstrap,Gentoo (its config.json)" in message
    assert "`--config.data.label_vocabulary=Adelie,Chinstrap,Gentoo`" in message


def size_model(spec, config):
    inputs = {"size": keras.Input((), name="size")}
    outputs = keras.layers.Dense(spec.num_classes)(keras.layers.Reshape((1,))(inputs["size"]))
    return keras.Model(inputs, outputs)


def test_a_tfrecord_string_label_trains_and_the_export_names_the_classes(tmp_path):
    examples = [PENGUINS[i % 3] for i in range(48)]
    config = tiny_config(
        **{
            "strategy.name": "one_device",
            "model.name": "tests.test_data_labels:size_model",
            "train.global_batch_size": 16,
            "eval.global_batch_size": 16,
            "train.steps": 60,
            "train.export": True,
            "optimizer.learning_rate": 0.05,
        }
    )
    config.data.update(_tfrecord(tmp_path, examples))
    results = train.train_and_evaluate(config, str(tmp_path / "model"))
    assert results["class_names"] == ["Adelie", "Chinstrap", "Gentoo"]
    assert results["eval"]["examples"] == 48
    serve = tf.saved_model.load(str(tmp_path / "model" / "export")).signatures["serving_default"]
    outputs = serve(size=tf.constant([0.5, 2.5]))
    assert outputs["class_names"].dtype == tf.string and outputs["class_names"].shape == (2,)
    names = [outputs["class_names"].numpy()[i].decode() for i in range(2)]
    assert names == [results["class_names"][c] for c in outputs["classes"].numpy()]


def test_what_start_up_found_is_told_with_the_input_on_the_tf_data_service(tmp_path):
    rows = [*ROWS, "NA,red,2,Gentoo"]
    dataset = data.get(_csv(tmp_path, rows, ROWS, incomplete="drop"))
    where = service_client.Service("grpc://127.0.0.1:1", 1, local=False, sharding="off")
    served = service_client.ServiceDataset(dataset, where, "run")
    assert served.notes == dataset.notes and "dropped 1 of 5 rows" in served.notes[0]
    assert served.spec.class_names == ("Adelie", "Chinstrap", "Gentoo")


def test_a_numeric_csv_of_unnamed_columns_takes_class_names_and_drops_gaps(tmp_path):
    lines = ["a,b,label", "1,2,cat", "3,,dog", "5,6,dog", "7,8,cat"]
    (tmp_path / "all.csv").write_text("\n".join(lines) + "\n")
    config = default.get_config().data
    path = str(tmp_path / "all.csv")
    config.update({"name": "csv", "train_files": path, "eval_files": path, "input_shape": (2,)})
    config.label_vocabulary = "auto"
    message = one_line_error("line 3, column `b` is missing", data.get, config)
    assert "name the columns in `data.features` with defaults ('b:float32=0', ...)" in message
    config.incomplete = "drop"
    x, labels = _eval(data.get(config))
    np.testing.assert_array_equal(x, [[1, 2], [5, 6], [7, 8]])
    np.testing.assert_array_equal(labels, [0, 1, 0])
