"""Wide and deep on a CSV file of mixed numeric and string columns.

    towerflow --config=examples/census.py --strategy=mirrored

Census-like rows (`examples/data/census-*.csv`, written by
`examples/make_census.py`): age and hours per week (numbers), education,
occupation and region (strings), and whether income is over 50K (the
label). The string columns reach the model as strings and become ids inside
it: education and occupation in Keras `Hashing` layers (hash buckets, as the
classic wide-and-deep recipe does), region in a `StringLookup` of its fixed
vocabulary (a table, which under `parameter_server` every worker holds a
copy of); it runs under every strategy, and the export serves raw rows too.
The wide part sees one-hot columns and the education x occupation cross;
the deep part, embeddings. The model is compiled here with its loss and
metrics (AUC, accuracy); towerflow trains it under any strategy. 1,000
steps of 256 take about 20 s on 2 CPU cores and reach eval AUC about 0.80.
"""

import pathlib

import keras

import trainer

DATA = pathlib.Path(__file__).resolve().parent / "data"
NUMERIC = {"age": (18.0, 80.0), "hours_per_week": (5.0, 90.0)}  # column: (low, high)
VOCABULARY = {  # the values of each string column (for the bucket counts)
    "education": ["Preschool", "HS-grad", "Some-college", "Assoc", "Bachelors", "Masters",
                  "Doctorate"],
    "occupation": ["Sales", "Tech-support", "Craft-repair", "Exec-managerial", "Prof-specialty",
                   "Handlers-cleaners", "Machine-op", "Adm-clerical", "Farming-fishing",
                   "Protective"],
    "region": ["North", "South", "East", "West", "Abroad"],
}  # fmt: skip


def get_config():
    """towerflow's default config, pointed at the census files and this model."""
    c = trainer.default_config()
    c.data.name = "csv"
    c.data.train_files = str(DATA / "census-train.csv")
    c.data.eval_files = str(DATA / "census-eval.csv")
    c.data.features = ",".join(
        [f"{name}:float32" for name in NUMERIC] + [f"{name}:string" for name in VOCABULARY]
    )
    c.data.label = "income"
    c.data.num_classes = 2
    c.model.name = "examples.census:build"
    c.train.steps = 1000
    c.train.global_batch_size = 256
    c.eval.every = 500
    c.optimizer.learning_rate = 3e-3
    return c


def build(spec, config) -> keras.Model:
    """The wide-and-deep model on the named columns; one logit, compiled."""
    inputs = {name: keras.Input((), name=name) for name in NUMERIC}
    inputs.update({name: keras.Input((), name=name, dtype="string") for name in VOCABULARY})
    numeric = [
        keras.layers.Reshape((1,))((inputs[name] - low) / (high - low))
        for name, (low, high) in NUMERIC.items()
    ]
    # About ten buckets per known value keeps collisions rare.
    sizes = {name: 10 * len(words) for name, words in VOCABULARY.items()}
    ids = {
        name: keras.layers.Hashing(sizes[name], name=f"{name}_ids")(inputs[name])
        for name in VOCABULARY
        if name != "region"
    }
    # A fixed vocabulary: index 0 for a value not in it, then one per value.
    sizes["region"] = len(VOCABULARY["region"]) + 1
    ids["region"] = keras.layers.StringLookup(vocabulary=VOCABULARY["region"], name="region_ids")(
        inputs["region"]
    )
    crossed = keras.layers.HashedCrossing(num_bins=sizes["education"] * sizes["occupation"])(
        (inputs["education"], inputs["occupation"])
    )
    wide = keras.layers.Concatenate()(
        [keras.layers.CategoryEncoding(sizes[n], output_mode="one_hot")(i) for n, i in ids.items()]
        + [keras.layers.CategoryEncoding(sizes["education"] * sizes["occupation"],
                                         output_mode="one_hot")(crossed)]
        + numeric
    )  # fmt: skip
    deep = keras.layers.Concatenate()(
        [keras.layers.Embedding(sizes[n], 8)(i) for n, i in ids.items()] + numeric
    )
    for units in (64, 32):
        deep = keras.layers.Dense(units, activation="relu")(deep)
    logit = keras.layers.Dense(1, name="income")(keras.layers.Concatenate()([wide, deep]))
    model = keras.Model(inputs, logit, name="wide_and_deep")
    model.compile(
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[
            keras.metrics.AUC(from_logits=True, name="auc"),
            keras.metrics.BinaryAccuracy(threshold=0.0, name="accuracy"),
        ],
    )
    return model
