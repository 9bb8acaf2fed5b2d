"""A seekable, shuffled order over record files (a TFDS split on disk).

ImageNet's train split is 1,024 TFRecord files; nothing can jump to the i-th record
of a file without reading the ones before it, so the global order of
expframe/data/order.py cannot be a permutation of single examples here. Instead:

- The files are dealt round-robin into `num_streams` streams (file i to stream
  i mod V). Global position p is element p div V of stream p mod V: the streams
  interleave one record at a time.
- A stream reads its files in a new pseudo-random order every epoch of its own,
  and each file in blocks of `block_size` consecutive records, each block in a
  pseudo-random order. Every permutation is stateless, seeded by (seed, stream,
  epoch, file, block), so the order depends on nothing but the seed.

Seeking to a position costs little: a stream skips whole files by their known
lengths and reads (without parsing or decoding) at most one file's records up to its
block; streams that pipeline w of W never needs are never opened when W divides V.
So a run resumes from `ctx.start_example` at any worker and replica count, with no
buffer to save: `stream_records` returns (global position, serialized record) pairs
from `start` on for one pipeline, to be parsed and decoded after.

Shuffling quality: records of one block stay within a window of V * block_size
positions; TFDS writes the examples of a split to its files in a random order, so
a file is already a random sample of the split.
"""

import math
from typing import Callable, List, Optional, Sequence, Tuple

import tensorflow as tf

FileSpec = Tuple[str, int, int]  # (path, records to skip at its start, records to read)


def tfds_files(builder, split: str) -> List[FileSpec]:
    """The files of a prepared TFDS split (slices like "train[:10%]" included), in order."""
    return [(f.filename, f.skip, f.take) for f in builder.info.splits[split].file_instructions]


def _seed(seed: tf.Tensor, *words) -> tf.Tensor:
    """A stateless seed (int64 [2]) from a base seed and integer words."""
    out = tf.stack([tf.cast(seed, tf.int64), tf.constant(0x5EED, tf.int64)])
    for word in words:
        out = tf.random.experimental.stateless_fold_in(out, tf.cast(word, tf.int64), alg="philox")
    return out


def _permutation(n: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """A pseudo-random permutation of 0 .. n-1 (int64), n >= 1."""
    n = tf.cast(n, tf.int64)
    return tf.random.experimental.index_shuffle(tf.range(n), seed, n - 1)


class _Streams:
    """The files as tensors; the records of stream s (a tensor) from its element `first` on.

    One traced function serves every stream, so building a pipeline costs the same
    for 1 or 64 streams.
    """

    def __init__(self, files: Sequence[FileSpec], num_streams: int, seed: int, block_size: int,
                 reader: Callable[[tf.Tensor], tf.data.Dataset]):
        self.paths = tf.constant([f[0] for f in files])
        self.skips = tf.constant([f[1] for f in files], tf.int64)
        self.takes = tf.constant([f[2] for f in files], tf.int64)
        self.v = num_streams
        self.lengths = [sum(f[2] for f in files[s::num_streams]) for s in range(num_streams)]
        self.seed, self.block, self.reader = seed, block_size, reader

    def records(self, stream: tf.Tensor, first: int) -> tf.data.Dataset:
        """Serialized records of `stream` from its element `first` on, forever."""
        length = tf.gather(tf.constant(self.lengths, tf.int64), stream)
        first = tf.constant(first, tf.int64)
        epoch, offset = first // length, first % length
        ids = tf.range(stream, tf.size(self.takes, out_type=tf.int64), self.v)  # files s, s + V, ...
        epochs = tf.data.Dataset.counter(0, dtype=tf.int64).map(lambda e: e + epoch)
        return epochs.flat_map(tf.autograph.experimental.do_not_convert(
            lambda e: self._epoch(stream, ids, e, tf.where(e == epoch, offset, tf.zeros_like(offset)))))

    def _epoch(self, stream, ids, epoch, offset) -> tf.data.Dataset:
        """Epoch `epoch` of a stream from its record `offset` on: whole files skipped by length."""
        ids = tf.gather(ids, _permutation(tf.size(ids), _seed(self.seed, stream, epoch)))
        takes = tf.gather(self.takes, ids)
        starts = tf.cumsum(takes, exclusive=True)
        first_file = tf.reduce_sum(tf.cast(starts <= offset, tf.int64)) - 1
        in_file = tf.where(tf.range(tf.size(takes, out_type=tf.int64)) == first_file, offset - starts, 0)
        files = tf.data.Dataset.from_tensor_slices(
            (ids, tf.gather(self.paths, ids), tf.gather(self.skips, ids), takes, in_file))
        return files.skip(first_file).flat_map(tf.autograph.experimental.do_not_convert(
            lambda i, path, skip, take, first: self._file(stream, epoch, i, path, skip, take, first)))

    def _file(self, stream, epoch, file_id, path, skip, take, first) -> tf.data.Dataset:
        """Records `first` .. take-1 of a file, shuffled within blocks; a resumed file
        skips (reads, never parses) only the records of the blocks before `first`."""
        first_block = first // self.block
        records = self.reader(path).skip(skip + first_block * self.block).take(take - first_block * self.block)
        blocks = tf.data.Dataset.zip(tf.data.Dataset.counter(first_block, dtype=tf.int64),
                                     records.batch(self.block))

        @tf.autograph.experimental.do_not_convert
        def shuffle(block_id, block):
            index = _permutation(tf.shape(block, out_type=tf.int64)[0],
                                 _seed(self.seed, stream, epoch, file_id, block_id))
            return tf.data.Dataset.from_tensor_slices(tf.gather(block, index))

        return blocks.flat_map(shuffle).skip(first - first_block * self.block)


def stream_records(files: Sequence[FileSpec], start: int, pipeline: int, num_pipelines: int, seed: int,
                   num_streams: int = 16, block_size: int = 625,
                   reader: Optional[Callable[[tf.Tensor], tf.data.Dataset]] = None) -> tf.data.Dataset:
    """(int64 global position, serialized record) of pipeline `pipeline`'s share from `start` on.

    Args:
      files: (path, skip, take) per file, e.g. `tfds_files(builder, split)`.
      start: global position to start at (the run's examples consumed).
      pipeline, num_pipelines: this input pipeline w and the number W of them; it
        gets positions start + w, start + w + W, ...
      seed: the order's seed.
      num_streams: V, streams the files are dealt into (at most one per file).
      block_size: records per shuffled block of a file.
      reader: path -> dataset of records (default `tf.data.TFRecordDataset`).
    """
    if not files:
        raise ValueError("stream_records: no files.")
    reader = reader or (lambda path: tf.data.TFRecordDataset(path))
    v = max(1, min(num_streams, len(files)))
    streams = _Streams(list(files), v, seed, block_size, reader)
    if min(streams.lengths) == 0:
        raise ValueError("stream_records: a stream has no records; use fewer streams or more files.")
    g = math.gcd(v, num_pipelines)
    # Positions start + w + kW are all congruent to start + w mod g: only the streams
    # with that residue are needed (all of them when g == 1, V/W of them when W | V).
    mine = [s for s in range(v) if s % g == (start + pipeline) % g]
    round_start = start // v * v  # every stream at its element start // V: positions round_start + s + kV
    # One record from each stream in turn: positions round_start + s + kV (s in mine), ascending.
    merged = tf.data.Dataset.from_tensor_slices(tf.constant(mine, tf.int64)).interleave(
        tf.autograph.experimental.do_not_convert(lambda s: streams.records(s, round_start // v)),
        cycle_length=len(mine), block_length=1, num_parallel_calls=len(mine), deterministic=True)
    # Drop the positions before start, then keep every (W/g)-th from start + (w mod g).
    before = sum(1 for s in mine if round_start + s < start)
    mine_only = merged.skip(before).shard(num_pipelines // g, pipeline // g)
    return tf.data.Dataset.zip(tf.data.Dataset.counter(start + pipeline, num_pipelines, dtype=tf.int64), mine_only)
