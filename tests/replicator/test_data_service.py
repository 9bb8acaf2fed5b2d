"""Train input through the tf.data service's shards: the input's own stream, exactly.

Shards run in this process ('local:K': a dispatcher and its worker each, on 127.0.0.1);
the launcher's shards, in processes of their own, are tests/test_stop_matrix.py's row.
"""

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import parameterized

import expframe as xf
from expframe.data import inputs, order
from expframe.errors import ConfigError
from expframe.replicator import data_service
from expframe.replicator.inputs import DistributedInput, InputContext
from tests import support
from tests.replicator.test_inputs import plain_input

NUM_TRAIN = 512   # the quickstart's shapes as the session's data_dir holds them: 16 steps of 32 per epoch
GLOBAL_BATCH = 32
STEPS = 36        # two epochs and a bit


@pytest.fixture(autouse=True)
def _shapes_dir(data_dir, request):
    if request.instance is not None:
        request.instance.data_dir = str(data_dir)


def _shapes_fn(data_dir):
    def input_fn(ctx):
        return inputs.shapes_input("train", ctx, ctx.get_per_replica_batch_size(GLOBAL_BATCH), training=True,
                                   seed=7, data_dir=data_dir, num_train=NUM_TRAIN, num_test=64)
    return input_fn


def _ids(rep, iterator, steps):
    """The example ids of each global batch, replica by replica."""
    return [np.concatenate([np.asarray(t) for t in rep.local_results(next(iterator)["id"])]) for _ in range(steps)]


class DataServiceTest(support.TestCase, parameterized.TestCase):

    def _reference(self, steps=STEPS):
        rep = xf.Replicator("cpu", 1)
        return np.stack(_ids(rep, iter(rep.distribute(_shapes_fn(self.data_dir), GLOBAL_BATCH)), steps))

    @parameterized.parameters((1, 2), (2, 2), (2, 3))
    def test_every_example_once_per_epoch_in_the_input_s_own_order(self, replicas, shards):
        reference = self._reference()
        rep = xf.Replicator("cpu", replicas)
        service = data_service.resolve(f"local:{shards}")
        self.assertEqual(service.shards, shards)
        served = np.stack(_ids(rep, iter(rep.distribute(_shapes_fn(self.data_dir), GLOBAL_BATCH, service)), STEPS))
        np.testing.assert_array_equal(served, reference)
        per_epoch = NUM_TRAIN // GLOBAL_BATCH
        for epoch in range(STEPS // per_epoch):
            ids = served[epoch * per_epoch:(epoch + 1) * per_epoch].ravel()
            self.assertEqual(sorted(ids.tolist()), list(range(NUM_TRAIN)), f"epoch {epoch}")

    def test_resume_mid_epoch_neither_skips_nor_repeats(self):
        reference = self._reference()
        rep = xf.Replicator("cpu", 2)
        iterator = iter(rep.distribute(_shapes_fn(self.data_dir), GLOBAL_BATCH, data_service.resolve("local:2")))
        first = _ids(rep, iterator, 7)  # 7 steps: mid-epoch, and mid-round of the 2 shards
        # A new process restores the position (batches, examples) and rebuilds the shards there.
        resumed = iter(rep.distribute(_shapes_fn(self.data_dir), GLOBAL_BATCH, data_service.resolve("local:2")))
        resumed.position.batches.assign(7)
        resumed.position.examples.assign(7 * GLOBAL_BATCH)
        self.assertIn("carried over", resumed.restart())
        np.testing.assert_array_equal(np.stack(first + _ids(rep, resumed, STEPS - 7)), reference)

    def test_two_workers_read_their_shares_through_the_shards(self):
        # Two workers of one replica each, simulated in one process, each with its own
        # pipeline served by the same 2 shards: together, the global batches of one replica.
        reference = self._reference(8)
        strategy = xf.Replicator("cpu", 2).strategy
        service = data_service.resolve("local:2")
        shares = [[b["id"].numpy() for b in DistributedInput(strategy, _shapes_fn(self.data_dir), 2, w,
                                                             service).dataset.take(8)] for w in range(2)]
        for step in range(8):  # worker w holds positions w, w + 2, ... of the global batch
            np.testing.assert_array_equal(np.concatenate([shares[0][step], shares[1][step]]),
                                          np.concatenate([reference[step][0::2], reference[step][1::2]]))

    def test_records_are_filtered_by_step_before_decoding(self):
        # order.in_step_shard on a (position, record) stream keeps what order.positions gives the shard.
        for w, workers in ((0, 1), (1, 2)):
            for k in range(3):
                ctx = InputContext(workers, w, 2, start_example=10, step_shard=(k, 3, 4))
                kept = order.in_step_shard(ctx, 10, tf.data.Dataset.zip(order.positions(InputContext(
                    workers, w, 2, start_example=10), 10), tf.data.Dataset.counter()))
                positions = [int(p) for p, _ in kept.take(12)]
                self.assertEqual(positions, [int(p) for p in order.positions(ctx, 10).take(12)])
                self.assertTrue(ctx.step_shard_read)

    def test_an_input_the_shards_cannot_split_is_refused_in_one_line(self):
        rep = xf.Replicator("cpu", 1)
        service = data_service.resolve("local:2")
        with self.assertRaisesRegex(ConfigError, r"^Trainer\.data_service: the train input_fn does not start at "
                                                 r"ctx\.start_example[^\n]*$"):
            rep.distribute(plain_input, 8, service)

        def ignores_shards(ctx):  # index-based, but every shard would prepare the whole stream
            start = ctx.start_example
            return tf.data.Dataset.counter(start, dtype=tf.int64).batch(ctx.get_per_replica_batch_size(8), True)

        with self.assertRaisesRegex(ConfigError, r"^Trainer\.data_service: [^\n]*not ctx\.step_shard"):
            rep.distribute(ignores_shards, 8, service)


@pytest.mark.parametrize("spec, message", [
    ("local:0", "'local:K' takes a shard count K >= 1"),
    ("local:x", "'local:K' takes a shard count K >= 1"),
    ("node7", "'node7' is not host:port"),
    (",", "names no shard"),
    (2, "must be a string"),
])
def test_bad_bindings_are_refused_in_one_line(spec, message):
    with pytest.raises(ConfigError, match=message) as raised:
        data_service.resolve(spec)
    assert "\n" not in str(raised.value) and "Trainer.data_service" in str(raised.value)


def test_the_launcher_s_shards_unless_off(monkeypatch):
    monkeypatch.delenv(data_service.SERVICE_ENV, raising=False)
    assert data_service.resolve(None) is None
    monkeypatch.setenv(data_service.SERVICE_ENV, "127.0.0.1:5001,127.0.0.1:5002")
    service = data_service.resolve(None)
    assert service.addresses == ["127.0.0.1:5001", "127.0.0.1:5002"] and "expframe.launch" in service.describe()
    assert data_service.resolve("off") is None


def test_the_launcher_names_the_same_variable():
    from expframe import launch  # pylint: disable=import-outside-toplevel
    assert launch.DATA_SERVICE_ENV == data_service.SERVICE_ENV

