"""The candidates an export serves: every held item's vector, searched with stock TensorFlow ops.

A `Catalogue` is the item ids and their vectors at one moment (an export's),
held as constants of the serving graph, so a SavedModel answers with
`tf.matmul`, `tf.gather` and `tf.math.top_k` alone and plain TF Serving
loads it. Brute force by default: every item's dot product with the query.
With `Partitioned(partitions, probes)`, k-means (numpy, at export) cuts the
items into `partitions` cells; a query scores the cells' centroids, then the
items of its `probes` best cells only: `partitions + probes * largest cell`
dot products instead of one per item.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from towerflow.errors import UserError

_KMEANS_SAMPLE = 200_000  # k-means learns its centroids on at most this many items


@dataclasses.dataclass(frozen=True)
class Partitioned:
    """An approximate index: k-means cells over the item vectors, the best `probes` searched.

    Attributes:
      partitions: the cells (at most the items held).
      probes: the cells searched per query (at most `partitions`).
      iterations: k-means iterations at export.
      seed: the k-means initialisation's.
    """

    partitions: int
    probes: int = 1
    iterations: int = 10
    seed: int = 0

    def __post_init__(self):
        if self.partitions < 1 or not 1 <= self.probes <= self.partitions:
            raise UserError(
                f"`Partitioned` (partitions {self.partitions}, probes {self.probes}) needs "
                "partitions >= 1 and 1 <= probes <= partitions; e.g. partitions=1000, probes=50."
            )


class Catalogue:
    """Item `ids` (`[n]`, int64 or strings) and their `vectors` (`[n, d]`), searched by `top_k`.

    Args:
      ids, vectors: the items, as numpy arrays (ids: integers, or bytes / str).
      index: None (brute force) or `Partitioned`.

    Raises:
      UserError: a partitioned index of more partitions than items.
    """

    def __init__(self, ids: np.ndarray, vectors: np.ndarray, index: Partitioned | None = None):
        ids = np.asarray(ids)
        strings = ids.dtype.kind in "SUO"
        self.ids = ids.astype(object) if strings else ids.astype(np.int64)
        self.none = b"" if strings else -1  # the id of a place no item fills
        self.vectors = np.asarray(vectors, np.float32)
        self.index = index
        self.cells = None  # partitioned: centroids `[p, d]`, members `[p, largest]` (n: none)
        if index is not None:
            if index.partitions > len(self.ids):
                raise UserError(
                    f"`Partitioned.partitions` ({index.partitions}) is more than the "
                    f"{len(self.ids)} items held; use at most {len(self.ids)} (e.g. about "
                    "sqrt(items)), or brute force (`index=None`)."
                )
            centroids, cell = kmeans(self.vectors, index.partitions, index.iterations, index.seed)
            self.cells = (centroids, _members(cell, index.partitions, len(self.ids)))

    def __len__(self) -> int:
        return len(self.ids)

    def dot_products(self) -> int:
        """The item (and centroid) dot products one query costs."""
        if self.cells is None:
            return len(self.ids)
        centroids, members = self.cells
        return len(centroids) + self.index.probes * members.shape[1]

    def top_k(self, queries: tf.Tensor, k: int) -> tuple[tf.Tensor, tf.Tensor]:
        """The `k` best item ids `[batch, k]` and their scores for `queries` `[batch, d]`.

        Fewer than `k` items held: the missing places are id -1 (strings: ""),
        score -inf.
        """
        queries = tf.cast(queries, tf.float32)
        ids = tf.constant(np.append(self.ids, self.none))  # the last: "no item"
        vectors = tf.constant(self.vectors)
        if self.cells is None:
            scores = tf.matmul(queries, vectors, transpose_b=True)
            found = _padded_top_k(scores, k)
            return tf.gather(ids, found.indices), found.values
        centroids, members = (tf.constant(a) for a in self.cells)
        cells = tf.math.top_k(tf.matmul(queries, centroids, transpose_b=True), self.index.probes)
        candidates = tf.reshape(tf.gather(members, cells.indices), [tf.shape(queries)[0], -1])
        padded = tf.concat([vectors, tf.zeros([1, vectors.shape[1]])], 0)
        scores = tf.einsum("bd,bcd->bc", queries, tf.gather(padded, candidates))
        scores = tf.where(candidates == len(self.ids), -np.inf, scores)
        found = _padded_top_k(scores, k)
        return tf.gather(ids, tf.gather(candidates, found.indices, batch_dims=1)), found.values


def _padded_top_k(scores: tf.Tensor, k: int):
    """`tf.math.top_k` of `scores`' rows, padded with -inf where a row has fewer than `k`.

    A padded place's index is the row's width (one past the last): "no item".
    """
    width = tf.shape(scores)[1]
    missing = tf.maximum(k - width, 0)
    scores = tf.pad(scores, [[0, 0], [0, missing]], constant_values=-np.inf)
    found = tf.math.top_k(scores, k)
    indices = tf.where(tf.math.is_inf(found.values), width, found.indices)
    return type(found)(found.values, indices)


def kmeans(
    vectors: np.ndarray, partitions: int, iterations: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Centroids `[partitions, d]` of `vectors` by k-means, and each vector's cell `[n]` (int32).

    Learned on a sample of at most `_KMEANS_SAMPLE` vectors (initialised
    from distinct ones of them), then every vector goes to its nearest centroid.
    """
    rng = np.random.default_rng(seed)
    n = len(vectors)
    sample = vectors[rng.choice(n, min(n, _KMEANS_SAMPLE), replace=False)]
    centroids = sample[rng.choice(len(sample), partitions, replace=False)].copy()
    for _ in range(iterations):
        cell = _nearest(sample, centroids)
        sums = np.zeros_like(centroids)
        np.add.at(sums, cell, sample)
        sizes = np.bincount(cell, minlength=partitions)
        centroids = sums / np.maximum(sizes, 1)[:, None].astype(np.float32)
        empty = sizes == 0  # an empty cell restarts at a random vector
        centroids[empty] = sample[rng.choice(len(sample), int(empty.sum()))]
    return centroids.astype(np.float32), _nearest(vectors, centroids)


def _nearest(vectors: np.ndarray, centroids: np.ndarray, chunk: int = 65536) -> np.ndarray:
    """The nearest centroid of each vector (squared Euclidean), in chunks of `chunk` vectors."""
    norms = (centroids**2).sum(1)
    cells = [
        np.argmin(norms[None, :] - 2.0 * vectors[i : i + chunk] @ centroids.T, axis=1)
        for i in range(0, len(vectors), chunk)
    ]
    return np.concatenate(cells).astype(np.int32)


def _members(cell: np.ndarray, partitions: int, n: int) -> np.ndarray:
    """`[partitions, largest cell]` int32: each cell's items, padded with `n` ("no item")."""
    order = np.argsort(cell, kind="stable")
    sizes = np.bincount(cell, minlength=partitions)
    members = np.full([partitions, max(int(sizes.max()), 1)], n, np.int32)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    place = np.arange(n) - np.repeat(starts, sizes)
    members[cell[order], place] = order
    return members
