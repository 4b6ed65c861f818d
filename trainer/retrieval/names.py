"""The raw string ids of the items a string item table holds, so an export can answer them.

A `DynamicEmbedding` of `key_dtype="string"` keeps each id as its 64-bit
fingerprint (`tables.key64`) and cannot give the string back. Retrieval
serves raw ids, so it keeps them itself: `ItemNames` maps each fingerprint
the training steps looked up to its string, in a hash table beside the item
table's first part (its ps member under `parameter_server`, where every
worker's steps write it). A step writes its whole global batch's names:
under several replicas each gathers every replica's (`all_gather_strings`,
the strings as padded byte codes: a collective takes numbers only), so under
`multi_worker` the chief knows the items the other workers trained.

The names are saved with the model in checkpoints. Names of ids the table no
longer holds (evicted) are dropped each time the catalogue is read
(`prune`), so they stay as many as the items held plus those evicted since.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from trainer.layers import DynamicEmbedding, tables

# Each byte value's one-byte string: byte codes back to strings (`all_gather_strings`).
_BYTES = tf.constant([bytes([b]) for b in range(256)])


class ItemNames(tf.Module):
    """Fingerprint -> raw string id of the items of a string `DynamicEmbedding`.

    Args:
      table: the item table (`key_dtype="string"`); the names live on its first
        part's device.
    """

    def __init__(self, table: DynamicEmbedding):
        super().__init__(name=f"{table.name}_names")
        self._part = table.parts[0]
        with self._part.on_device():
            self.names = tf.lookup.experimental.MutableHashTable(tf.int64, tf.string, "")

    def remember(self, ids: tf.Tensor) -> tf.Operation:
        """Notes a training step's raw string `ids` (this replica's; every replica's are kept)."""
        replica = tf.distribute.get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            ids = all_gather_strings(replica, ids)
        with self._part.on_device():
            return self.names.insert(tables.key64(ids), ids)

    def of(self, keys: tf.Tensor) -> tf.Tensor:
        """The raw ids of int64 `keys` ("" for a key never remembered)."""
        with self._part.on_device():
            return tf.reshape(self.names.lookup(keys), tf.shape(keys))  # a shape Keras can read

    def prune(self, held: np.ndarray) -> None:
        """Forgets (eagerly) the names of keys not among `held`, the keys the table holds now."""
        with self._part.on_device():
            keys, _ = self.names.export()
            gone = np.setdiff1d(keys.numpy(), held)
            if gone.size:
                self.names.remove(tf.constant(gone, tf.int64))


def all_gather_strings(replica: tf.distribute.ReplicaContext, strings: tf.Tensor) -> tf.Tensor:
    """Every replica's 1-D `strings`, in replica order (`ReplicaContext.all_gather` of strings).

    Each string goes as its bytes' codes, padded to the longest of every
    replica's, with its length.
    """
    lengths = tf.strings.length(strings)
    chars = tf.strings.bytes_split(strings)
    codes = tf.cast(tf.reshape(tf.io.decode_raw(chars.flat_values, tf.uint8), [-1]), tf.int32)
    codes = chars.with_flat_values(codes).to_tensor()
    width = tf.shape(codes)[1]
    widest = tf.reduce_max(replica.all_gather(width[None], 0))
    codes = tf.pad(codes, [[0, 0], [0, widest - width]])
    codes, lengths = replica.all_gather(codes, 0), replica.all_gather(lengths, 0)
    joined = tf.strings.reduce_join(tf.gather(_BYTES, codes), 1)
    return tf.strings.substr(joined, tf.zeros_like(lengths), lengths)
