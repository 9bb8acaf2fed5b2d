"""Acting: a policy with Gaussian exploration noise steps an environment and feeds replay.

The actor holds its own copy of the policy network and takes the learner's weights
through `update(weights)` (numpy arrays, as `keras.Model.get_weights()` gives them);
it writes transitions through an adder into a replay. Nothing here knows about the
learner, so the same actor can later run in another process, fed weights and
writing transitions over RPC.

Exploration (Acme's D4PG): a = clip(pi(o) + sigma * N(0, I), -1, 1), noise from the
actor's own seeded generator, so acting is deterministic given the seed.

Seeds of actor processes (`actor_seeds`): numpy's `SeedSequence` with the run's seed as
entropy and (actor id, restart count, resume step) as spawn key, so a restarted actor
and every actor of a resumed learner act with new streams (episodes and noise), and the
same four numbers give the same streams again.
"""

import json
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import keras
import numpy as np
import tensorflow as tf

_NUMPY_ACTIVATIONS = {
    "linear": lambda x: x,
    "tanh": np.tanh,
    "relu": lambda x: np.maximum(x, 0.0),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0))),
}


def _chain(policy) -> Optional[List[keras.layers.Layer]]:
    """The policy's layers if it is a chain of Dense, LayerNormalization (last axis) and
    Activation layers with activations numpy knows (as `d4pg_policy` is); else None."""
    layers = []
    for layer in policy.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        activation = getattr(getattr(layer, "activation", None), "__name__", None)
        if isinstance(layer, (keras.layers.Dense, keras.layers.Activation)) and activation in _NUMPY_ACTIVATIONS:
            layers.append(layer)
        elif isinstance(layer, keras.layers.LayerNormalization) and tuple(layer.axis) in ((-1,), (1,)):
            layers.append(layer)
        else:
            return None
    return layers


def _numpy_layer(layer: keras.layers.Layer) -> Callable[[np.ndarray], np.ndarray]:
    """The layer as a numpy function of its current weights (copied now)."""
    if isinstance(layer, keras.layers.Activation):
        return _NUMPY_ACTIVATIONS[layer.activation.__name__]
    if isinstance(layer, keras.layers.Dense):
        kernel = layer.kernel.numpy()
        bias = layer.bias.numpy() if layer.use_bias else 0.0
        activation = _NUMPY_ACTIVATIONS[layer.activation.__name__]
        return lambda x: activation(x @ kernel + bias)
    gamma = layer.gamma.numpy() if layer.scale else 1.0
    beta = layer.beta.numpy() if layer.center else 0.0
    epsilon = layer.epsilon

    def layer_norm(x):
        centred = x - x.mean(-1, keepdims=True)
        return centred / np.sqrt(np.square(centred).mean(-1, keepdims=True) + epsilon) * gamma + beta
    return layer_norm


def weight_names(*models: keras.Model) -> List[str]:
    """Names for the weights of `models`, in `get_weights()` order, one model after the other:
    'LAYER_INDEX:LAYER_CLASS/WEIGHT' where LAYER_INDEX counts the layers that hold weights,
    through nested models, from the first model on. A model composed of these models (the
    acting policy: encoder, then policy) gets the same names when its weights come in the
    same order, and different ones where a weight comes elsewhere."""
    leaves: List[keras.layers.Layer] = []

    def walk(layer):
        inner = getattr(layer, "layers", None)
        if inner:
            for sub in inner:
                walk(sub)
        elif layer.weights:
            leaves.append(layer)
    for model in models:
        walk(model)
    owner = {}
    for i, layer in enumerate(leaves):
        for weight in layer.weights:
            owner.setdefault(id(weight), f"{i}:{type(layer).__name__}/{weight.name}")
    return [owner.get(id(w), f"?:{type(model).__name__}/{w.name}") for model in models for w in model.weights]


class PolicyExecutor:
    """Runs a Keras policy on one observation at a time.

    A policy that is a plain chain of Dense / LayerNormalization / Activation layers
    runs in numpy on a copy of its weights taken at `update` (30 us a step against
    250 us for a tf.function call on a batch of one, on this project's 2-core CPU);
    any other policy runs as a traced tf.function. The numpy chain is checked against
    Keras once, on random weights, and not used if they disagree (e.g. a model that
    branches, or a mixed-precision policy).
    """

    def __init__(self, policy: keras.Model, observation_size):
        self.policy = policy
        # A size (state features, float32) or a shape (pixels: the policy's input dtype, uint8).
        shape = (observation_size,) if isinstance(observation_size, int) else tuple(observation_size)
        self._dtype = tf.as_dtype(policy.inputs[0].dtype) if len(shape) > 1 else tf.float32
        self._act = tf.function(lambda o: policy(o, training=False),
                                input_signature=[tf.TensorSpec((None,) + shape, self._dtype)])
        self._chain = _chain(policy) if len(shape) == 1 else None
        if self._chain is not None and not self._numpy_matches_keras(shape[0]):
            self._chain = None
        self._numpy = None
        self.update(policy.get_weights())

    @property
    def uses_numpy(self) -> bool:
        return self._chain is not None

    def _numpy_matches_keras(self, observation_size: int) -> bool:
        saved = self.policy.get_weights()
        rng = np.random.default_rng(0)
        self.policy.set_weights([rng.normal(0.0, 0.5, w.shape).astype(w.dtype) for w in saved])
        probe = rng.normal(0.0, 1.0, (4, observation_size)).astype(np.float32)
        expected = np.asarray(self.policy(probe, training=False), np.float32)
        got = probe
        for fn in [_numpy_layer(layer) for layer in self._chain]:
            got = fn(got)
        self.policy.set_weights(saved)
        return got.shape == expected.shape and np.allclose(got, expected, atol=1e-4)

    def update(self, weights: Sequence[np.ndarray]) -> None:
        """Takes new weights (in `keras.Model.get_weights()` order)."""
        self.policy.set_weights(list(weights))
        if self._chain is not None:
            self._numpy = [_numpy_layer(layer) for layer in self._chain]

    def __call__(self, observation: np.ndarray) -> np.ndarray:
        """The action for one observation (float32 [action_size])."""
        return self.batch(np.asarray(observation)[None])[0]

    def batch(self, observations: np.ndarray) -> np.ndarray:
        """The actions for a batch of observations (float32 [batch, action_size]): one call
        for the environments of actors that act together (`run_together`)."""
        x = np.asarray(observations, self._dtype.as_numpy_dtype)
        if self._numpy is None:
            return self._act(x).numpy()   # a batched convolution: equal to one at a time up to rounding
        # Row by row: a matmul over several rows may round differently from one row (BLAS
        # blocks them), and these microseconds buy actions that are the same bits whether
        # an actor acts alone or with others.
        out = []
        for row in x:
            row = row[None]
            for fn in self._numpy:
                row = fn(row)
            out.append(row[0])
        return np.stack(out).astype(np.float32)


class SynchronousActor:
    """Steps `environment` with the noisy policy, in this process, on request.

    Example:
      actor = SynchronousActor(env, PolicyExecutor(policy, env.observation_size), adder,
                               sigma=0.3, seed=0)
      actor.update(learner_policy.get_weights())
      actor.run(800)                  # 800 environment steps, transitions into replay

    Args:
      environment: `reset() -> observation`, `step(action) -> (observation, reward,
        discount, last)`, `action_size`.
      policy: a `PolicyExecutor` (observation -> action in [-1, 1]).
      adder: an `NStepAdder` (or anything with `start(observation)` and `add(...)`).
      sigma: standard deviation of the Gaussian exploration noise.
      seed: seeds the noise.
    """

    def __init__(self, environment, policy: PolicyExecutor, adder, sigma: float, seed: int):
        if sigma < 0:
            raise ValueError(f"exploration sigma must be >= 0, got {sigma!r}.")
        self.environment = environment
        self.policy = policy
        self.adder = adder
        self.sigma = float(sigma)
        self._rng = np.random.default_rng(seed)
        self._observation: Optional[np.ndarray] = None
        self._episode_return = 0.0
        self.env_steps = 0
        self.episodes = 0
        self.acting_time = 0.0      # seconds spent in run() in this process
        self.timed_steps = 0        # environment steps taken in those seconds
        self._finished: List[float] = []  # returns of episodes ended since the last read

    def update(self, weights: Sequence[np.ndarray]) -> None:
        """Takes the learner's policy weights."""
        self.policy.update(weights)

    def select_action(self, observation: np.ndarray) -> np.ndarray:
        return self.explore(self.policy(observation))

    def explore(self, action: np.ndarray) -> np.ndarray:
        """The policy's action with this actor's exploration noise, clipped to [-1, 1]."""
        noise = self.sigma * self._rng.standard_normal(action.shape).astype(np.float32)
        return np.clip(action + noise, -1.0, 1.0)

    def observe(self) -> np.ndarray:
        """The observation to act on, starting an episode if none is running."""
        if self._observation is None:
            self._observation = self.environment.reset()
            self.adder.start(self._observation)
            self._episode_return = 0.0
        return self._observation

    def record(self, action: np.ndarray, step: Tuple[np.ndarray, float, float, bool]) -> None:
        """Writes the environment's answer to `action` (its `step` result) into replay."""
        observation, reward, discount, last = step
        self.adder.add(action, reward, discount, observation, last)
        self._episode_return += reward
        self.env_steps += 1
        self._observation = observation
        if last:
            self.episodes += 1
            self._finished.append(self._episode_return)
            self._observation = None

    def run(self, num_steps: int) -> None:
        """Takes `num_steps` environment steps, starting episodes as they end."""
        started = time.perf_counter()
        for _ in range(num_steps):
            action = self.select_action(self.observe())
            self.record(action, self.environment.step(action))
        self.acting_time += time.perf_counter() - started
        self.timed_steps += num_steps

    def finished_returns(self) -> List[float]:
        """Returns of the episodes that ended since the last call."""
        out, self._finished = self._finished, []
        return out

    # -- state for checkpoints ---------------------------------------------------------

    def state(self) -> Dict[str, np.ndarray]:
        """Everything the next steps depend on, as numpy arrays: counters, the noise
        generator, the episode in progress (`open`, its current `observation` and return,
        the returns finished but not read yet), the adder's pending steps (`adder/...`)
        and the environment's state (`environment/...`: physics, random state, frames)."""
        open_ = self._observation is not None
        out = {"counters": np.array([self.env_steps, self.episodes], np.int64),
               "rng": np.array(json.dumps(self._rng.bit_generator.state)),
               "open": np.array(open_),
               "observation": np.asarray(self._observation) if open_ else np.zeros(0, np.float32),
               "episode_return": np.array(self._episode_return, np.float64),
               "finished": np.array(self._finished, np.float64)}
        if hasattr(self.adder, "state"):
            out.update({f"adder/{k}": v for k, v in self.adder.state().items()})
        if self.environment is not None and hasattr(self.environment, "state"):
            out.update({f"environment/{k}": v for k, v in self.environment.state().items()})
        return out

    def restore(self, state: Dict[str, np.ndarray]) -> bool:
        """Loads `state()`: the next `run` continues the episode in progress (its next step
        is the one the saved actor would have taken). A state without the episode (written
        before checkpoints held it; or by an actor without an environment) loads its counters
        and noise only: the next `run` starts a new episode.

        Returns:
          Whether the episode and environment were restored.
        """
        self.env_steps, self.episodes = (int(v) for v in state["counters"])
        self._rng.bit_generator.state = json.loads(str(state["rng"]))
        self._observation = None
        self._finished = []
        environment = {k[len("environment/"):]: v for k, v in state.items() if k.startswith("environment/")}
        if "open" not in state or not environment or self.environment is None:
            return False
        self.environment.restore(environment)
        if hasattr(self.adder, "restore"):
            self.adder.restore({k[len("adder/"):]: v for k, v in state.items() if k.startswith("adder/")})
        if bool(state["open"]):
            self._observation = np.asarray(state["observation"])
        self._episode_return = float(state["episode_return"])
        self._finished = [float(r) for r in state["finished"]]
        return True


def run_together(actors: Sequence[SynchronousActor], num_steps: int) -> None:
    """Each of `actors` takes `num_steps` environment steps, in lockstep: one policy call
    for all their observations (`PolicyExecutor.batch`), then every environment steps at
    once where it can (`step_async` / `step_wait`: a pixel environment's render worker),
    else one after the other. The actors share one `PolicyExecutor` (one set of weights);
    each keeps its own environment, noise, adder and counters, so each writes what its own
    `run(num_steps)` would: the same bits for a numpy policy (state features), the same
    up to float rounding (~1e-7 in an action) for one that runs through TensorFlow.

    Raises:
      ValueError: the actors do not share one policy.
    """
    policy = actors[0].policy
    if any(actor.policy is not policy for actor in actors):
        raise ValueError("run_together: the actors must share one PolicyExecutor (one set of weights).")
    started = time.perf_counter()
    for _ in range(num_steps):
        observations = np.stack([actor.observe() for actor in actors])
        actions = [actor.explore(action) for actor, action in zip(actors, policy.batch(observations), strict=True)]
        waiting = []
        for actor, action in zip(actors, actions, strict=True):
            if hasattr(actor.environment, "step_async"):
                actor.environment.step_async(action)
                waiting.append((actor, action))
            else:
                actor.record(action, actor.environment.step(action))
        for actor, action in waiting:
            actor.record(action, actor.environment.step_wait())
    elapsed = time.perf_counter() - started
    for actor in actors:
        actor.acting_time += elapsed
        actor.timed_steps += num_steps


def actor_seeds(seed: int, actor_id: int, restart: int = 0, resume_step: int = 0) -> Tuple[int, int]:
    """The (environment seed, noise seed) of one actor.

    Both come from `np.random.SeedSequence(seed, spawn_key=(actor_id, restart,
    resume_step))`: actor `actor_id`'s `restart`-th restart (0: its first start) in a
    learner process that started (or resumed) at learner step `resume_step`. Each of
    the three changes the streams even when it is 0 (in a spawn key every word counts;
    trailing zeros of a plain entropy list do not: `SeedSequence([s, 0])` seeds as `s`).

    Args:
      seed: the run's seed (`run_experiment.seed`), >= 0.
      actor_id, restart, resume_step: integers >= 0.

    Returns:
      Two seeds in [0, 2**32).
    """
    for name, value in (("seed", seed), ("actor_id", actor_id), ("restart", restart), ("resume_step", resume_step)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"actor_seeds: {name}={value!r} must be an integer >= 0.")
    sequence = np.random.SeedSequence(int(seed), spawn_key=(int(actor_id), int(restart), int(resume_step)))
    environment_seed, noise_seed = sequence.generate_state(2)
    return int(environment_seed), int(noise_seed)


def episode_returns(environment, policy: PolicyExecutor, episodes: int) -> List[float]:
    """Undiscounted returns of `episodes` whole episodes with the noiseless policy."""
    returns = []
    for _ in range(episodes):
        observation, total, last = environment.reset(), 0.0, False
        while not last:
            observation, reward, _, last = environment.step(policy(observation))
            total += reward
        returns.append(total)
    return returns


def trivial_policy_returns(make_environment: Callable[[int], object], action_size: int,
                           episodes: int = 10) -> Dict[str, float]:
    """Mean undiscounted returns of two trivial policies: the floor a learned one must clear.

    Uniformly random actions in [-1, 1] (one generator, seed 0) and zero actions, each for
    `episodes` episodes, episode i in a fresh `make_environment(i)`.

    Returns:
      {"random_policy_return": ..., "zero_action_return": ...}.
    """
    rng = np.random.default_rng(0)
    returns: Dict[str, List[float]] = {"random_policy_return": [], "zero_action_return": []}
    for seed in range(episodes):
        for name, totals in returns.items():
            environment, total, last = make_environment(seed), 0.0, False
            environment.reset()
            while not last:
                action = (rng.uniform(-1.0, 1.0, action_size) if name == "random_policy_return"
                          else np.zeros(action_size))
                _, reward, _, last = environment.step(action)
                total += reward
            totals.append(total)
    return {name: float(np.mean(totals)) for name, totals in returns.items()}
