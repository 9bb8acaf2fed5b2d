"""Actor processes: act with the learner's weights over RPC, send transitions, stop when told."""

import os
import subprocess
import sys
import tempfile

import keras
import numpy as np

from expframe.models.d4pg import d4pg_policy
from expframe.rl.actor_process import ProcessActor
from expframe.rl.actors import PolicyExecutor, SynchronousActor
from expframe.rl.adders import NStepAdder
from expframe.rl.environments import control_suite
from expframe.rl.experience import TransitionBuffer
from expframe.rl.rpc import ActorClient, LearnerService
from tests.support import TestCase

SHAPES = {"observation": (5,), "action": (1,), "reward": (), "discount": (), "next_observation": (5,)}
GIN = """
D4PGTask.environment = @control_suite
control_suite.name = 'cartpole/balance'
D4PGTask.policy_network = @d4pg_policy
d4pg_policy.layer_sizes = (16,)
D4PGTask.n_step = 3
D4PGTask.initial_sigma = 0.0          # noiseless at learner step 0, --sigma from step 1000 on
D4PGTask.sigma_decay_steps = 1000
"""


class ProcessActorTest(TestCase):

    def test_acts_with_the_version_fetched_just_before(self):
        keras.utils.set_random_seed(0)
        policy = d4pg_policy(observation_size=5, action_size=1, layer_sizes=(16,))
        service = LearnerService(policy.get_weights(), SHAPES, capacity=1000)
        try:
            buffer = TransitionBuffer()
            actor = SynchronousActor(control_suite(seed=0), PolicyExecutor(policy, 5), NStepAdder(buffer, 3, 0.99),
                                     sigma=0.3, seed=0)
            runner = ProcessActor(ActorClient(service.address, 2), actor, buffer, weights_every=50)
            zero = [np.zeros_like(w) for w in policy.get_weights()]
            for expected_version in (1, 2, 3):
                service.publish(zero)
                self.assertTrue(runner.step())
                self.assertEqual(service.versions_used[2], expected_version)
            # The policy acted with the published (zero) weights: actions are pure noise around 0.
            np.testing.assert_array_equal(actor.policy(np.ones(5, np.float32)), [0.0])
            # 3 chunks of 50 steps, no episode end yet: the last n_step - 1 = 2 steps wait in the adder.
            self.assertEqual(service.inserted, 148)
            self.assertEqual(service.max_version_lag, 0)
            service.close()
            self.assertFalse(runner.step())
        finally:
            service.close()


class _PublishingEnvironment:
    """An environment that has the learner publish new weights just before chosen steps
    (counted from 0 over the whole run), i.e. while the actor is in the middle of a chunk."""

    def __init__(self, environment, publish_before):
        self.environment, self.publish_before, self.steps = environment, publish_before, 0
        self.observation_size, self.action_size = environment.observation_size, environment.action_size

    def reset(self):
        return self.environment.reset()

    def step(self, action):
        if self.steps in self.publish_before:
            self.publish_before[self.steps]()
        self.steps += 1
        return self.environment.step(action)


def _constant_action_weights(policy, action):
    """Weights under which d4pg_policy outputs `action` for every observation: all zero
    (layer norms give 0, tanh and elu keep it) but the last layer's bias, atanh(action)."""
    weights = [np.zeros_like(w) for w in policy.get_weights()]
    weights[-1] = np.full_like(weights[-1], np.arctanh(action))
    return weights


class WeightStalenessTest(TestCase):

    def test_every_step_acts_with_weights_at_most_one_chunk_old(self):
        # Version v of the weights makes the policy output v / 10 whatever it sees, and
        # there is no exploration noise: each transition's action names the version it
        # was acted with. Publishes land mid-chunk, several between two fetches.
        keras.utils.set_random_seed(0)
        policy = d4pg_policy(observation_size=5, action_size=1, layer_sizes=(16,))
        service = LearnerService(_constant_action_weights(policy, 0.0), SHAPES, capacity=1000)
        weights_every, chunks = 20, 6
        published_before = [3, 20, 27, 28, 29, 61, 79, 80, 99, 100, 101, 118]
        publish = {i: (lambda v=v: service.publish(_constant_action_weights(policy, v / 20)))
                   for v, i in enumerate(published_before, start=1)}
        try:
            buffer = TransitionBuffer()
            environment = _PublishingEnvironment(control_suite(seed=0), publish)
            actor = SynchronousActor(environment, PolicyExecutor(policy, 5), NStepAdder(buffer, 1, 0.99),
                                     sigma=0.0, seed=0)
            runner = ProcessActor(ActorClient(service.address, 5), actor, buffer, weights_every)
            reported, actions = [], []
            for _ in range(chunks):
                self.assertTrue(runner.step())
                reported.append(service.versions_used[5])
                actions.append(service.take()["action"][:, 0])
            acted = np.rint(np.concatenate(actions) * 20).astype(int)   # the version behind each step
            self.assertEqual(len(acted), weights_every * chunks)
            for t, version in enumerate(acted):
                fetched_at = t - t % weights_every
                # The newest version when this step's chunk fetched its weights ...
                self.assertEqual(version, sum(i < fetched_at for i in published_before), t)
                # ... so never older than what was newest weights_every steps before (plus that fetch).
                self.assertGreaterEqual(version, sum(i < t - weights_every + 1 for i in published_before), t)
            # What the actor reports with each insert is the version it acted with.
            self.assertEqual(reported, [acted[c * weights_every] for c in range(chunks)])
            self.assertEqual(reported, [0, 1, 5, 5, 7, 9])
            self.assertEqual(service.max_version_lag, 4)   # chunk 1 acted with 1 while 2..5 appeared
        finally:
            service.close()


class ActorSubprocessTest(TestCase):

    def test_subprocess_fetches_weights_and_inserts_until_closed(self):
        keras.utils.set_random_seed(0)
        policy = d4pg_policy(observation_size=5, action_size=1, layer_sizes=(16,))
        service = LearnerService(policy.get_weights(), SHAPES, capacity=400)
        with tempfile.TemporaryDirectory() as tmp:
            gin_file = os.path.join(tmp, "config.gin")
            with open(gin_file, "w", encoding="utf-8") as f:
                f.write(GIN)
            stats = os.path.join(tmp, "stats.json")
            process = subprocess.Popen(
                [sys.executable, "-m", "expframe.rl.actor_process", f"--address={service.address}", "--actor_id=7",
                 "--seed=1", "--sigma=0.5", "--weights_every=100", f"--gin_config={gin_file}",
                 f"--stats_file={stats}"], stderr=subprocess.PIPE, text=True)
            try:
                self.assertTrue(service.wait_for(200, timeout=90), "no transitions from the actor process")
                # Acted with the weights of learner step 0: the schedule's sigma 0, so every
                # action is the policy's own (its last layer starts near zero).
                self.assertLess(np.max(np.abs(service.take()["action"])), 0.01)
                version = service.publish(policy.get_weights(), step=1000)
                # One chunk may be in flight with the old weights; the next is acted with the new.
                self.assertTrue(service.wait_for(200, timeout=30))
                self.assertGreaterEqual(service.versions_used[7], version)
                # Versions are learner steps (`publish(step=...)`): that chunk is 1000 behind.
                self.assertIn(service.max_version_lag, (0, version))
                taken = service.take()
                self.assertEqual(taken["observation"].shape[1:], (5,))
                self.assertTrue(np.all(np.abs(taken["action"]) <= 1.0))
                # Weights of step 1000: the schedule has reached --sigma=0.5.
                fresh = taken["action"][-100:]
                self.assertGreater(np.std(fresh), 0.3)
                service.close()
                self.assertEqual(process.wait(timeout=30), 0, process.stderr.read())
                self.assertTrue(os.path.exists(stats))
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                service.close()
