"""The seekable shuffled order over record files (expframe/data/records.py)."""

import os

import numpy as np
import tensorflow as tf

from expframe.data import records, shapes
from tests.support import TestCase

LENGTHS = (7, 5, 9, 6, 8, 4)  # records per file; file 0 is read from its 2nd record (a TFDS-style skip)


class StreamRecordsTest(TestCase):

    def setUp(self):
        super().setUp()
        self.files, self.stream_ids, next_id = [], [[], [], []], 0
        for i, n in enumerate(LENGTHS):
            path = os.path.join(self.get_temp_dir(), f"part-{i}.tfrecord")
            with tf.io.TFRecordWriter(path) as writer:
                for j in range(n):
                    writer.write(str(next_id).encode())
                    if not (i == 0 and j == 0):
                        self.stream_ids[i % 3].append(next_id)
                    next_id += 1
            self.files.append((path, 1 if i == 0 else 0, n - 1 if i == 0 else n))

    def _read(self, start, pipeline=0, pipelines=1, count=40):
        ds = records.stream_records(self.files, start, pipeline, pipelines, seed=5, num_streams=3, block_size=3)
        return [(int(p), int(r)) for p, r in ds.take(count).as_numpy_iterator()]

    def test_global_order_at_any_pipeline_count_and_start(self):
        reference = self._read(0, count=110)
        self.assertEqual([p for p, _ in reference], list(range(110)))
        at = dict(reference)
        # W = 2: every stream, every 2nd record; W = 3 = V: only its own stream.
        for pipelines, start in ((2, 13), (3, 61)):
            for w in range(pipelines):
                got = self._read(start, w, pipelines, count=10)
                positions = [start + w + k * pipelines for k in range(10)]
                self.assertEqual([p for p, _ in got], positions, (pipelines, start, w))
                self.assertEqual([r for _, r in got], [at[p] for p in positions], (pipelines, start, w))

    def test_each_stream_epoch_reads_its_records_once_in_a_new_order(self):
        reference = dict(self._read(0, count=200))
        for stream, ids in enumerate(self.stream_ids):
            n = len(ids)
            first = [reference[stream + 3 * k] for k in range(n)]
            second = [reference[stream + 3 * k] for k in range(n, 2 * n)]
            self.assertCountEqual(first, ids)
            self.assertCountEqual(second, ids)
            self.assertNotEqual(first, second)
            self.assertNotEqual(first, sorted(first))
        self.assertNotIn(0, reference.values())  # the skipped record

    def test_no_files(self):
        with self.assertRaisesRegex(ValueError, "no files"):
            records.stream_records([], 0, 0, 1, seed=0)


def test_a_tfds_split_read_by_stream(data_dir):
    builder = shapes.Shapes(config=shapes.shapes_config(32, 512, 64), data_dir=str(data_dir))
    files = records.tfds_files(builder, "train[10:50]")
    assert sum(f[2] for f in files) == 40
    ds = records.stream_records(files, 0, 0, 1, seed=3, num_streams=4, block_size=8)
    ids = [int(builder.info.features.deserialize_example(r)["id"]) for _, r in ds.take(80)]
    assert sorted(ids[:40]) == list(range(10, 50)) == sorted(ids[40:])
    assert ids[:40] != ids[40:]
    np.testing.assert_array_equal(
        [int(builder.info.features.deserialize_example(r)["id"]) for _, r in
         records.stream_records(files, 30, 0, 1, seed=3, num_streams=4, block_size=8).take(10)], ids[30:40])
