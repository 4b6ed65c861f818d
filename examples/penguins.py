"""Penguin species from a CSV as real files are: class names as labels, `NA` for missing.

    python -m examples.penguins data/   # writes data/penguins-{train,eval}.csv

The files have the columns of the Palmer penguins CSV (`species`, `island`,
bill, flipper and mass measurements, `sex`, `year`), with made-up rows
(deterministic, seeded) of the same kind: the label `species` is a name
(Adelie, Chinstrap, Gentoo), `island` and `sex` are strings, and some rows
hold `NA` (all four measurements of a few, `sex` of more). docs/your-job.md trains
on them with `data.label_vocabulary=auto`, `sex:string=unknown` and
`data.incomplete=drop`; `build` is the model: the measurements scaled, the
strings hashed (no vocabulary table, so it runs under every strategy), one
hidden layer. 300 steps reach eval accuracy 1.0 in seconds (see docs/your-job.md).
"""

import csv
import pathlib
import sys

import keras
import numpy as np

COLUMNS = [
    "species",
    "island",
    "bill_length_mm",
    "bill_depth_mm",
    "flipper_length_mm",
    "body_mass_g",
    "sex",
    "year",
]
MEASUREMENTS = COLUMNS[2:6]
# species: (islands it lives on, mean of each measurement); spreads are SPREAD of the mean.
SPECIES = {
    "Adelie": (("Torgersen", "Biscoe", "Dream"), (38.8, 18.3, 190.0, 3700.0)),
    "Chinstrap": (("Dream",), (48.8, 18.4, 196.0, 3730.0)),
    "Gentoo": (("Biscoe",), (47.5, 15.0, 217.0, 5080.0)),
}
SPREAD = (0.05, 0.05, 0.03, 0.1)
SCALE = {  # measurement: (centre, width), to bring it near [-1, 1]
    "bill_length_mm": (44.0, 6.0),
    "bill_depth_mm": (17.0, 2.0),
    "flipper_length_mm": (200.0, 15.0),
    "body_mass_g": (4200.0, 800.0),
}
STRINGS = {"island": 3, "sex": 3}  # string column: values it takes (for the hash buckets)


def rows(count: int, seed: int) -> list[list[str]]:
    """`count` penguin rows as CSV values; about 1 in 40 lacks its measurements, 1 in 12 its sex."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(count):
        species = rng.choice(list(SPECIES))
        islands, means = SPECIES[species]
        values = [m * (1 + s * rng.normal()) for m, s in zip(means, SPREAD)]
        measured = [f"{v:.1f}" if v < 1000 else f"{v:.0f}" for v in values]
        if rng.rand() < 0.025:
            measured = ["NA"] * 4
        sex = "NA" if rng.rand() < 0.08 else rng.choice(["male", "female"])
        year = str(rng.choice([2007, 2008, 2009]))
        out.append([species, rng.choice(islands), *measured, sex, year])
    return out


def write(directory: str) -> None:
    """Writes `penguins-train.csv` (280 rows) and `penguins-eval.csv` (80) into `directory`."""
    path = pathlib.Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for split, count, seed in (("train", 280, 0), ("eval", 80, 1)):
        with open(path / f"penguins-{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            writer.writerows(rows(count, seed))


def build(spec, config) -> keras.Model:
    """The measurements scaled, `island` and `sex` hashed to one-hot; `num_classes` logits."""
    inputs = {name: keras.Input((), name=name) for name in MEASUREMENTS}
    inputs.update({name: keras.Input((), name=name, dtype="string") for name in STRINGS})
    parts = [
        keras.layers.Reshape((1,))((inputs[name] - centre) / width)
        for name, (centre, width) in SCALE.items()
    ]
    for name, values in STRINGS.items():
        ids = keras.layers.Hashing(8 * values)(inputs[name])
        parts.append(keras.layers.CategoryEncoding(8 * values, output_mode="one_hot")(ids))
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Concatenate()(parts))
    return keras.Model(inputs, keras.layers.Dense(spec.num_classes)(hidden), name="penguins")


if __name__ == "__main__":
    write(sys.argv[1] if len(sys.argv) > 1 else "data")
