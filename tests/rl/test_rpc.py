"""The learner's RPC service: weights out with versions, transitions in, bounded inserts."""

import threading
import time

import numpy as np

from expframe.rl.rpc import FIELDS, MAX_HELD_INSERTS, ActorClient, LearnerService
from tests.support import TestCase

SHAPES = {"observation": (3,), "action": (1,), "reward": (), "discount": (), "next_observation": (3,)}


def _transitions(n, start=0.0):
    base = start + np.arange(n, dtype=np.float32)
    return {"observation": np.stack([base] * 3, 1), "action": base[:, None], "reward": base,
            "discount": np.full(n, 0.99, np.float32), "next_observation": np.stack([base + 1] * 3, 1)}


class LearnerServiceTest(TestCase):

    def setUp(self):
        super().setUp()
        self.weights = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)]
        self.service = LearnerService(self.weights, SHAPES, capacity=10)
        self.client = ActorClient(self.service.address, actor_id=4, timeout_s=20)

    def tearDown(self):
        self.service.close()
        super().tearDown()

    def test_binds_to_loopback_on_a_free_port(self):
        host, port = self.service.address.rsplit(":", 1)
        self.assertEqual(host, "127.0.0.1")
        self.assertGreater(int(port), 0)

    def test_weights_out_with_versions(self):
        version, weights = self.client.weights()
        self.assertEqual(version, 0)
        for got, want in zip(weights, self.weights, strict=True):
            np.testing.assert_array_equal(got, want)
        new = [w * 2 + 1 for w in self.weights]
        self.assertEqual(self.service.publish(new), 1)
        version, weights = self.client.weights()
        self.assertEqual(version, 1)
        np.testing.assert_array_equal(weights[0], new[0])

    def test_transitions_in_in_order(self):
        self.assertEqual(self.client.insert(0, _transitions(3), [12.5]), 1)
        self.assertEqual(self.client.insert(0, _transitions(2, start=10.0), []), 1)
        self.assertEqual(self.service.pending(), 5)
        taken = self.service.take()
        np.testing.assert_array_equal(taken["reward"], [0, 1, 2, 10, 11])
        np.testing.assert_array_equal(taken["next_observation"][:, 0], [1, 2, 3, 11, 12])
        self.assertEqual(set(taken), set(FIELDS))
        self.assertEqual(self.service.take_returns(), [12.5])
        self.assertEqual(self.service.pending(), 0)
        self.assertEqual(self.service.inserted, 5)
        self.assertEqual(self.service.versions_used, {4: 0})

    def test_pending_transitions_are_bounded_by_capacity(self):
        self.assertEqual(self.client.insert(0, _transitions(8), []), 1)
        self.assertEqual(self.client.insert(0, _transitions(3), []), 0)   # 11 > capacity 10
        self.assertEqual(self.service.pending(), 8)
        self.service.take()
        self.assertEqual(self.client.insert(0, _transitions(3), []), 1)
        self.assertEqual(self.service.refused, 1)

    def test_insert_limit_holds_actors_back_until_allowed(self):
        self.service.allow(4)
        self.assertEqual(self.client.insert(0, _transitions(3), []), 1)
        self.assertEqual(self.client.insert(0, _transitions(3), []), 0)   # 6 > limit 4
        self.service.allow(6)
        self.assertEqual(self.client.insert(0, _transitions(3), []), 1)
        self.assertEqual(self.service.inserted, 6)

    def test_an_insert_that_does_not_fit_is_held_until_allowed(self):
        service = LearnerService(self.weights, SHAPES, capacity=100, insert_wait_s=60.0)
        try:
            service.allow(2)
            clients = [ActorClient(service.address, actor_id=i, timeout_s=90) for i in range(MAX_HELD_INSERTS + 1)]
            results = {}

            def insert(i):
                results[i] = clients[i].insert(0, _transitions(3, start=10.0 * i), [])

            threads = [threading.Thread(target=insert, args=(i,)) for i in range(MAX_HELD_INSERTS)]
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 30
            while service._held < MAX_HELD_INSERTS:   # pylint: disable=protected-access
                self.assertLess(time.monotonic(), deadline, f"held: {results}")
                time.sleep(0.01)
            # One more than may be held: refused at once, while the others are still held
            # (had it been held, its 60 s would have outlasted theirs, started earlier).
            self.assertEqual(clients[-1].insert(0, _transitions(3), []), 0)
            self.assertTrue(all(thread.is_alive() for thread in threads))
            self.assertEqual((service.refused, service.inserted), (1, 0))
            # Room appears: every held insert goes through, without a retry.
            service.allow(3 * MAX_HELD_INSERTS)
            for thread in threads:
                thread.join(timeout=60)
            self.assertEqual(results, {i: 1 for i in range(MAX_HELD_INSERTS)})
            self.assertEqual((service.refused, service.inserted), (1, 3 * MAX_HELD_INSERTS))
            self.assertEqual(sorted(service.take()["reward"][::3]), [10.0 * i for i in range(MAX_HELD_INSERTS)])
        finally:
            service.close()

    def test_version_lag_is_recorded(self):
        for _ in range(3):
            self.service.publish(self.weights)
        self.client.insert(1, _transitions(1), [])
        self.assertEqual(self.service.max_version_lag, 2)
        self.assertEqual(self.service.versions_used[4], 1)

    def test_closed_service_tells_actors_to_stop(self):
        self.service.close()
        self.assertEqual(self.client.weights()[0], -1)
        self.assertEqual(self.client.insert(0, _transitions(1), []), -1)
        self.assertFalse(self.service.wait_for(1, timeout=0.1))
