"""Actor processes: act with the learner's weights over RPC, send transitions, stop when told."""

import os
import subprocess
import sys
import tempfile

import keras
import numpy as np

from expframe.models.d4pg import d4pg_policy
from expframe.rl.actor_process import ProcessActor, TransitionBuffer
from expframe.rl.actors import PolicyExecutor, SynchronousActor
from expframe.rl.adders import NStepAdder
from expframe.rl.environments import control_suite
from expframe.rl.rpc import ActorClient, LearnerService
from tests.support import TestCase

SHAPES = {"observation": (5,), "action": (1,), "reward": (), "discount": (), "next_observation": (5,)}
GIN = """
D4PGTask.environment = @control_suite
control_suite.name = 'cartpole/balance'
D4PGTask.policy_network = @d4pg_policy
d4pg_policy.layer_sizes = (16,)
D4PGTask.n_step = 3
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
                version = service.publish(policy.get_weights())
                service.take()
                # One chunk may be in flight with the old weights; the next is acted with the new.
                self.assertTrue(service.wait_for(200, timeout=30))
                self.assertGreaterEqual(service.versions_used[7], version)
                self.assertLessEqual(service.max_version_lag, 1)
                taken = service.take()
                self.assertEqual(taken["observation"].shape[1:], (5,))
                self.assertTrue(np.all(np.abs(taken["action"]) <= 1.0))
                service.close()
                self.assertEqual(process.wait(timeout=30), 0, process.stderr.read())
                self.assertTrue(os.path.exists(stats))
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
                service.close()
