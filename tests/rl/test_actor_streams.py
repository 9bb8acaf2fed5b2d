"""One sender per actor id, and weights checked by name: a second live actor under one id is
refused with a clear error (its steps would otherwise join the first one's episodes in one
replay stream), and an actor whose policy lists its weights in another order than the
learner's refuses to load them (three encoder kernels share one shape)."""

import contextlib
import io

import keras
import numpy as np

import expframe as xf
from expframe.models.d4pg import d4pg_policy
from expframe.models.pixel_encoder import drq_encoder
from expframe.rl.actors import weight_names
from expframe.rl.rpc import ActorClient, DuplicateActorError, LearnerService, WeightNamesError
from expframe.tasks.d4pg_observations import ObservationNetworks
from tests.support import TestCase

SHAPES = {"observation": (3,), "action": (1,), "reward": (), "discount": (), "next_observation": (3,)}


def _steps(n, start):
    base = start + np.arange(n, dtype=np.float32)
    return {"observation": np.stack([base] * 3, 1), "action": base[:, None], "reward": base,
            "discount": np.ones(n, np.float32), "next_observation": np.stack([base + 1] * 3, 1)}


class _Environment:
    observation_shape, action_size = (16, 16, 6), 1


class _Networks(ObservationNetworks):
    """The learner's encoder and policy as D4PGTask builds them (in a replicator's scope)."""

    def __init__(self):
        self.environment = _Environment()
        self._observation_network_fn = lambda observation_shape: drq_encoder(observation_shape, num_filters=4,
                                                                            num_layers=3, feature_size=8)
        self._policy_fn = lambda observation_size, action_size: d4pg_policy(observation_size, action_size,
                                                                           layer_sizes=(16,))


class ActorStreamsTest(TestCase):

    def test_a_second_live_sender_of_an_actor_id_is_refused_with_one_line(self):
        weights = [np.ones((2, 3), np.float32)]
        service = LearnerService(weights, SHAPES, capacity=100)
        try:
            first, second = ActorClient(service.address, 3, timeout_s=20), ActorClient(service.address, 3, timeout_s=20)
            other = ActorClient(service.address, 4, timeout_s=20)
            self.assertEqual(first.insert(0, _steps(5, 0.0), []), 1)
            log = io.StringIO()
            with contextlib.redirect_stderr(log):
                with self.assertRaisesRegex(DuplicateActorError, "another live actor sends as actor id 3; give each "
                                                                 "actor its own --actor_id"):
                    second.insert(0, _steps(5, 100.0), [])
                with self.assertRaises(DuplicateActorError):
                    second.weights()
            lines = log.getvalue().splitlines()
            self.assertEqual(len(lines), 1, lines)   # logged once per refused sender
            self.assertIn("refused a second actor sending as actor id 3", lines[0])
            self.assertEqual(service.duplicates_refused, 2)
            # Only the first sender's steps are in actor 3's stream; other ids are not affected.
            self.assertEqual(other.insert(0, _steps(2, 50.0), []), 1)
            self.assertEqual(first.insert(0, _steps(5, 5.0), []), 1)
            inserts = service.take_inserts()
            self.assertEqual([(a, list(s["reward"])) for a, s in inserts],
                             [(3, [0, 1, 2, 3, 4]), (4, [50, 51]), (3, [5, 6, 7, 8, 9])])
            # The learner released the id (its actor exited): a restart sends under it.
            service.release(3)
            self.assertEqual(second.weights()[0], 0)
            with self.assertRaises(DuplicateActorError):
                first.weights()
        finally:
            service.close()

    def test_weights_go_by_name_and_a_reordering_is_refused(self):
        keras.utils.set_random_seed(0)
        networks = _Networks()
        with xf.Replicator("cpu", 2).scope():   # the learner's variables are mirrored
            networks.observation_network, _ = networks._observation_networks(lambda f, **k: f(**k))  # pylint: disable=protected-access
            networks.policy = networks._policy_fn(8, 1)  # pylint: disable=protected-access
        names = networks.acting_weight_names()
        acting = networks.make_acting_policy(_Environment())   # what an actor process builds
        self.assertEqual(weight_names(acting), names)
        kernels = [n for n in names if n.endswith("Conv2D/kernel")]
        self.assertEqual(len(kernels), 3)
        # Two of them share a shape: loading by position alone would not notice a swap.
        shapes = [w.shape for w, n in zip(networks.acting_weights(), names, strict=True) if n in kernels]
        self.assertEqual(shapes[1], shapes[2])

        service = LearnerService(networks.acting_weights(), SHAPES, capacity=10, names=names)
        try:
            client = ActorClient(service.address, 0, timeout_s=20)
            self.assertEqual(client.weight_names(), names)
            client.check_names(weight_names(acting))   # the same: no error
            swapped = list(names)
            i, j = names.index(kernels[1]), names.index(kernels[2])
            swapped[i], swapped[j] = swapped[j], swapped[i]
            with self.assertRaisesRegex(WeightNamesError, f"weight {i} is the learner's {names[i]!r} but this "
                                                          f"actor's {names[j]!r}"):
                client.check_names(swapped)
            with self.assertRaisesRegex(WeightNamesError, f"sends {len(names)} weights, this actor's policy has 2"):
                client.check_names(names[:2])
        finally:
            service.close()
        unnamed = LearnerService(networks.acting_weights(), SHAPES, capacity=10)
        try:
            ActorClient(unnamed.address, 0, timeout_s=20).check_names(["anything"])   # no names given: not checked
        finally:
            unnamed.close()


class _PublishingEnvironment:
    """State-feature cartpole that runs `hooks[i]` before its i-th step (the learner moving on)."""

    def __init__(self, hooks):
        from expframe.rl.environments import control_suite  # pylint: disable=import-outside-toplevel
        self.environment, self.hooks, self.steps = control_suite(seed=0), hooks, 0
        self.observation_size, self.action_size = self.environment.observation_size, self.environment.action_size

    def reset(self):
        return self.environment.reset()

    def step(self, action):
        if self.steps in self.hooks:
            self.hooks[self.steps]()
        self.steps += 1
        return self.environment.step(action)


class WeightLagTest(TestCase):

    def test_a_chunk_acted_with_weights_too_many_learner_steps_old_is_held_back(self):
        from expframe.rl.actor_pool import lag_histogram  # pylint: disable=import-outside-toplevel
        from expframe.rl.actor_process import ProcessActor  # pylint: disable=import-outside-toplevel
        from expframe.rl.actors import PolicyExecutor, SynchronousActor  # pylint: disable=import-outside-toplevel
        from expframe.rl.adders import NStepAdder  # pylint: disable=import-outside-toplevel
        from expframe.rl.experience import TransitionBuffer  # pylint: disable=import-outside-toplevel
        from expframe.rl.rpc import STALE  # pylint: disable=import-outside-toplevel
        keras.utils.set_random_seed(0)
        policy = d4pg_policy(observation_size=5, action_size=1, layer_sizes=(8,))
        weights = policy.get_weights()
        service = LearnerService(weights, SHAPES, capacity=1000, version=100)   # a learner resumed at step 100
        service.max_lag = 4
        try:
            # Chunk 1 (steps 0-9, weights of step 100): the learner publishes step 110 mid-chunk,
            # so the chunk arrives 10 learner steps behind: held back (dropped), not inserted.
            # Chunk 2 (fresh weights of 110): 3 steps behind when it arrives: inserted.
            hooks = {5: lambda: service.publish(weights, step=110), 25: lambda: service.publish(weights, step=113)}
            buffer = TransitionBuffer()
            actor = SynchronousActor(_PublishingEnvironment(hooks), PolicyExecutor(policy, 5),
                                     NStepAdder(buffer, 1, 0.99), sigma=0.1, seed=0)
            runner = ProcessActor(ActorClient(service.address, 0, timeout_s=20), actor, buffer, weights_every=10)
            self.assertTrue(runner.step())
            self.assertEqual((runner.stale_chunks, service.stale, service.pending()), (1, 1, 0))
            self.assertTrue(runner.step())   # acts 10 .. 19 with step 110's weights: lag 0
            self.assertTrue(runner.step())   # 20 .. 29, step 113 published at 25: lag 3 <= 4
            self.assertEqual((runner.stale_chunks, service.pending(), service.versions_used[0]), (1, 20, 110))
            lags = service.take_lags()
            self.assertEqual(lags, {0: 10, 3: 10})
            self.assertEqual(service.take_lags(), {})   # since the last call
            histogram = lag_histogram(lags)
            self.assertEqual((histogram["weight_lag_0"], histogram["weight_lag_3to4"], histogram["weight_lag_1"],
                              histogram["weight_lag_33plus"], histogram["weight_lag_mean"]), (10, 10, 0, 0, 1.5))
            # Without a bound the old chunk goes in, and its lag is counted.
            service.max_lag = None
            self.assertEqual(ActorClient(service.address, 1, timeout_s=20).insert(100, _steps(2, 0.0), []), 1)
            self.assertEqual(service.take_lags(), {13: 2})
            self.assertNotEqual(STALE, 0)
        finally:
            service.close()
