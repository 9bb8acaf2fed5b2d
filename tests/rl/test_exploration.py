"""DrQ-v2's decaying exploration noise: the schedule, and that an actor acts with the sigma of
the learner step its weights are from (in-process and in a `ProcessActor`)."""

import keras
import numpy as np

from expframe.models.d4pg import d4pg_policy
from expframe.rl.actor_process import ProcessActor
from expframe.rl.actors import PolicyExecutor, SynchronousActor
from expframe.rl.adders import NStepAdder
from expframe.rl.environments import control_suite
from expframe.rl.experience import TransitionBuffer
from expframe.rl.exploration import ExplorationSchedule
from expframe.rl.rpc import ActorClient, LearnerService
from tests.support import TestCase

SHAPES = {"observation": (5,), "action": (1,), "reward": (), "discount": (), "next_observation": (5,)}


class ExplorationScheduleTest(TestCase):

    def test_linear_from_initial_to_the_actors_sigma_then_flat(self):
        schedule = ExplorationSchedule(initial=1.0, decay_steps=10_000)
        self.assertEqual([schedule(s, 0.3) for s in (0, 2_500, 5_000, 10_000, 50_000)],
                         [1.0, 0.825, 0.65, 0.3, 0.3])
        self.assertAlmostEqual(schedule(5_000, 0.1), 0.55)        # each actor decays to its own sigma
        self.assertEqual(ExplorationSchedule(None, 0)(7, 0.3), 0.3)   # no schedule: constant


class ProcessActorExplorationTest(TestCase):

    def test_each_chunk_is_acted_with_the_sigma_of_its_weights_learner_step(self):
        keras.utils.set_random_seed(0)
        policy = d4pg_policy(observation_size=5, action_size=1, layer_sizes=(8,))
        service = LearnerService(policy.get_weights(), SHAPES, capacity=1000, version=5_000)
        try:
            buffer = TransitionBuffer()
            executor = PolicyExecutor(policy, 5)
            actor = SynchronousActor(control_suite("cartpole/balance", seed=0), executor, NStepAdder(buffer, 1, 0.99),
                                     sigma=0.3, seed=4)
            runner = ProcessActor(ActorClient(service.address, 0, timeout_s=20), actor, buffer, weights_every=50,
                                  exploration=ExplorationSchedule(1.0, 10_000))
            self.assertTrue(runner.step())
            self.assertEqual(actor.sigma, 0.65)   # weights of learner step 5,000: halfway
            taken = service.take()
            # The actions are exactly the policy's plus 0.65 times the actor's noise stream.
            noise = 0.65 * np.random.default_rng(4).standard_normal((50, 1)).astype(np.float32)
            means = np.concatenate([executor(o) for o in taken["observation"]]).reshape(-1, 1)
            np.testing.assert_allclose(taken["action"], np.clip(means + noise, -1.0, 1.0), atol=1e-6)
            service.publish(policy.get_weights(), step=20_000)
            self.assertTrue(runner.step())
            self.assertAlmostEqual(actor.sigma, 0.3)   # past the decay: the actor's own sigma
        finally:
            service.close()
