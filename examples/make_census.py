"""Writes the small census-like CSV files the wide-and-deep example trains on.

    python examples/make_census.py   # rewrites examples/data/census-{train,eval}.csv

Deterministic (fixed seed), so the shipped files can be rebuilt bit for bit.
Income (the label, 1 = over 50K) follows a hidden logistic rule with
interactions between education and occupation, which the wide part (crosses)
and the deep part (embeddings) of the model can both pick up.
"""

import csv
import pathlib

import numpy as np

EDUCATION = ["Preschool", "HS-grad", "Some-college", "Assoc", "Bachelors", "Masters", "Doctorate"]
OCCUPATION = [
    "Sales",
    "Tech-support",
    "Craft-repair",
    "Exec-managerial",
    "Prof-specialty",
    "Handlers-cleaners",
    "Machine-op",
    "Adm-clerical",
    "Farming-fishing",
    "Protective",
]
REGION = ["North", "South", "East", "West", "Abroad"]
COLUMNS = ["age", "hours_per_week", "education", "occupation", "region", "income"]


def rows(count: int, seed: int) -> list[list]:
    rng = np.random.RandomState(seed)
    education_effect = np.linspace(-1.5, 1.5, len(EDUCATION))
    occupation_effect = rng.normal(0, 0.8, len(OCCUPATION))
    cross = rng.normal(0, 0.7, (len(EDUCATION), len(OCCUPATION)))
    region_effect = rng.normal(0, 0.4, len(REGION))
    out = []
    for _ in range(count):
        age = int(rng.randint(18, 80))
        hours = int(np.clip(rng.normal(40, 10), 5, 90))
        e, o, r = (
            rng.randint(len(EDUCATION)),
            rng.randint(len(OCCUPATION)),
            rng.randint(len(REGION)),
        )
        logit = (
            -1.0
            + 0.04 * (age - 40)
            - 0.0008 * (age - 40) ** 2
            + 0.04 * (hours - 40)
            + education_effect[e]
            + occupation_effect[o]
            + cross[e, o]
            + region_effect[r]
        )
        income = int(rng.rand() < 1 / (1 + np.exp(-logit)))
        out.append([age, hours, EDUCATION[e], OCCUPATION[o], REGION[r], income])
    return out


def main() -> None:
    data = pathlib.Path(__file__).with_name("data")
    data.mkdir(exist_ok=True)
    all_rows = rows(6000, seed=7)
    for name, part in (("train", all_rows[:5000]), ("eval", all_rows[5000:])):
        with open(data / f"census-{name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(COLUMNS)
            writer.writerows(part)


if __name__ == "__main__":
    main()
