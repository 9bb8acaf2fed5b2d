"""D4PG (Barth-Maron et al. 2018, "Distributed Distributional Deterministic Policy
Gradients"): a distributional critic, n-step returns, prioritised replay, a replicated
learner; acting in this process (`synchronous`), on the host between host calls.

One host call of K learner steps (the trainer's `steps_per_loop`) runs as:
  before_train_steps   the actor takes the learner's current policy weights and acts
                       until the environment steps reach min_replay_size + learner
                       steps * global_batch / samples_per_insert (Acme's ratio: 32
                       samples per insert at batch 256 is 8 environment steps per
                       learner step); then the K global batches are sampled from
                       replay (importance-sampling exponent annealed by learner step),
                       split into per-replica shares and put in the input queue.
  train_step (x K)     replica context: each replica takes its share; critic and
                       policy gradients are averaged over replicas by their wrapped
                       optimizers; each replica sends its examples' TD errors to the
                       host (`tf.numpy_function`) keyed by their place in the batch.
  after_train_steps    the TD errors of all K steps, ordered by key (so the result
                       does not depend on which replica's call ran first), become the
                       new priorities. Batches of one host call are drawn before any
                       of that call's updates: priorities lag by up to K - 1 steps.

The learner step (Acme's D4PG learner):
  critic  target = project(r + d * Z_target(o', pi_target(o'))) onto the support;
          loss = mean(w * cross_entropy(target, Z(o, a))), w the importance weights.
  policy  loss = mean(dpg(E[Z(o, pi(o))])), dQ/da clipped to norm 1 (`dqda_clipping`).
  targets copied from the online networks every `target_update_period` learner
          steps, at the start of a step (step 0 included). Target weights are
          replica-local (sync-on-read) variables: every replica copies its own, the
          same values everywhere, with no communication, inside the step.

Checkpoints hold the networks, target networks, optimizers, and the acting state
(`_ActingState`): the replay (rows, priorities, sampler state) with the episode in
progress (the n-step adder's pending steps; for pixels the frame replay's stream), the
actor's counters, noise generator, current observation and episode return, the acting
environment's state (MuJoCo's integration state, the model values the task set for the
episode, the task's random state, the step within the episode; for pixels the frame
stack, the physics from the render worker) and the weight-lag counts. A resumed run acts
on from where the checkpoint was: with `run_experiment.deterministic = True` it logs the
same numbers and ends with the same checkpoint as a run never stopped (the learner's
and the actor's speeds aside; tests/test_d4pg_resume.py). No random stream restarts or
is reseeded on resume. The evaluation environment needs nothing: it is reseeded from
(seed, step) at each evaluation. Free-running actor processes (`num_actors > 0`) take
their seeds from `actor_seeds(seed, actor id, restart count, step)` (step: the learner step
resumed from), so a restarted actor and the actors of a resumed learner act with new
episodes and noise: their episodes in progress are not in the checkpoint. Actors in
lockstep (`run_experiment.deterministic = True`, `expframe.rl.lockstep`) send their state
with each chunk; the checkpoint holds each one's state after the last round the learner
took, and a resumed run continues as if it never stopped (tests/test_d4pg_lockstep.py).
"""

import collections
import math
import threading
import time
from typing import Any, Callable, Dict, Optional

import gin
import keras
import numpy as np
import tensorflow as tf

import expframe as xf
from expframe.models.d4pg import d4pg_critic, d4pg_policy
from expframe.rl import experience, losses
from expframe.rl.actor_pool import lag_histogram
from expframe.rl.actors import PolicyExecutor, SynchronousActor, episode_returns, trivial_policy_returns
from expframe.rl.environments import control_suite
from expframe.rl.exploration import ExplorationSchedule
from expframe.rl.learner_input import PreparedBatches
from expframe.rl.npz_state import npz_arrays, npz_bytes
from expframe.rl.rpc import MAX_HELD_INSERTS
from expframe.tasks.base import StopRequested, Task, model_losses
from expframe.tasks.d4pg_observations import ObservationNetworks


def _replica_local(next_creator, **kwargs):
    """Variables each replica updates on its own; a checkpoint holds replica 0's value."""
    kwargs["synchronization"] = tf.VariableSynchronization.ON_READ
    kwargs["aggregation"] = tf.VariableAggregation.ONLY_FIRST_REPLICA
    return next_creator(**kwargs)


def _check(binding: str, ok: bool, value, what: str) -> None:
    if not ok:
        raise xf.ConfigError(f"D4PGTask.{binding}={value!r} {what}.")


@gin.configurable
class D4PGTask(ObservationNetworks, Task):
    """D4PG on an environment, acting in this process (see module docstring).

    Defaults are Acme's D4PG, except that replay is prioritised (as in the D4PG paper;
    Acme samples uniformly, which `priority_exponent = 0` gives). Gradient clipping by
    global norm 40 (Acme's `clipping`) is bound in the gin file on the scoped optimizer
    wrappers (`actor/wrap_optimizer.clip_global_norm`, `critic/wrap_optimizer.clip_global_norm`).

    Args:
      environment: `fn(seed=) -> environment` (e.g. `@control_suite`).
      policy_network, critic_network: `fn(observation_size, action_size) -> keras.Model`.
        A network's regularisation losses (`model.losses`, e.g. `kernel_regularizer=...`)
        are added to the loss of the optimizer that trains it (the critic's and the
        observation network's to the critic loss, and to `loss`); logged as
        `critic_reg_loss` and `actor_reg_loss` when there are some.
      actor_optimizer, critic_optimizer: build Keras optimizers (default Adam 1e-4),
        called and wrapped under the gin scopes `actor/` and `critic/`.
      discount: gamma per environment step.
      n_step: steps per replayed transition.
      sigma: exploration noise (actions in [-1, 1]); with `initial_sigma`, the value
        the noise decays to.
      initial_sigma: None (sigma throughout), or the noise at learner step 0, decaying
        linearly to `sigma` (each actor's own, with `actor_sigmas`) over
        `sigma_decay_steps` learner steps: DrQ-v2's schedule (Yarats et al. 2021,
        arXiv 2107.09645: 1.0 to 0.1 over its first 100,000 agent steps), which keeps a
        pixel policy from settling on one action before its critic can tell states apart.
        Actors read the step from the weights they act with, so the decay is the same
        in-process, in actor processes and after a resume.
      sigma_decay_steps: learner steps of the decay (with `initial_sigma`).
      target_update_period: learner steps between target network updates.
      target_update_tau: what fraction of the way each update moves the targets to the
        online networks: 1.0 copies them (Acme's D4PG); tau < 1 is Polyak averaging,
        target <- tau * online + (1 - tau) * target (DrQ: 0.01 every 2 steps). Step 0
        copies either way, so the targets start equal to the online networks.
      samples_per_insert: sampled transitions per inserted one; sets the acting rate.
      min_replay_size: environment steps taken before learning starts.
      max_replay_size: replay capacity (oldest overwritten).
      priority_exponent: alpha of prioritised replay (0: uniform).
      importance_sampling_exponent: beta at step 0, annealed linearly to 1 over
        `importance_annealing_steps` learner steps.
      dqda_clipping: norm bound on dQ/da in the policy loss (None: off).
      preactivation_penalty: lambda of a penalty lambda * mean(x ** 2) on the policy's
        tanh pre-activations x, added to the policy loss (0: off, Acme's loss). It keeps
        the tanh from saturating, where its gradient vanishes and the policy can no
        longer follow its critic (Andrychowicz et al. 2017, HER, arXiv 1707.01495, which
        adds the squared pre-activations to the actor's cost for this reason). The
        policy's last layer must be a tanh activation (as `d4pg_policy`'s); logged as
        `policy_preactivation_rms`.
      eval_episodes: episodes per evaluation, noiseless policy.
      num_actors: 0 acts in this process (`synchronous`); K > 0 starts K actor
        processes fed weights and sending transitions over RPC (`expframe.rl.actor_pool`),
        each seeded from (run seed, actor id, restart count, resume step).
      actor_sigmas: exploration sigma per actor (None: `sigma` for all).
      actors_per_process: actors that share one actor process (1: a process each). Those
        of a process import TensorFlow once, share one policy and act in lockstep with one
        batched policy call per step, their render workers rendering at the same time;
        each keeps its own id, seeds, environment, noise and replay stream. 32 actors at 8
        per process are 4 TensorFlow processes instead of 32.
      weights_every: environment steps between an actor's weight fetches.
      max_actor_restarts: actor restarts allowed over the run, all actors together.
      actor_service_address: host:port of the learner's RPC service (port 0: free one;
        '0.0.0.0:PORT' serves actors on other hosts).
      actor_timeout_s: the longest the learner waits for the actors' transitions, counted
        from when an actor was ready (its first call to the learner).
      max_weight_lag: None, or the most learner steps the weights an actor acted with may
        be behind the learner's when its chunk arrives; an older chunk is dropped and the
        actor fetches and acts again (at least Trainer.steps_per_loop: weights are published
        once per host call). The lags are logged either way: `weight_lag_*` train metrics
        count the transitions inserted at each lag (learner steps) since the run started
        (in-process acting: all at lag 0, kept in checkpoints) or the learner process did
        (actor processes). Not used in lockstep, where every chunk is one host call old.
      lockstep: whether actor processes act in lockstep with the learner
        (`expframe.rl.lockstep`: the weights each chunk acts with and the chunks each
        learner step takes fixed by counts, so runs repeat). None: when
        `run_experiment.deterministic` is on. False with deterministic is refused (such a
        run would not repeat); True without it measures lockstep's cost
        (benchmarks/d4pg_lockstep.py).
      actor_startup_timeout_s: the longest an actor process may take to start (import
        TensorFlow, start its renderer) before its first call; the time each took is logged
        and `actor_startup_s` (the slowest) is a train metric.
      observation_network: None (state features go straight into the networks), or
        `fn(observation_shape) -> keras.Model` turning observations into features (pixels:
        `@drq_encoder`), shared as Acme's D4PG shares it: the critic's optimizer trains it,
        the policy reads its features with gradients stopped, and the critic's target
        reads a target copy of it; policy and critic networks then take its features.
    """

    checkpoint_input = False
    xla_incompatible = "sends its TD errors to the host (tf.numpy_function)"

    def __init__(self, environment: Callable[..., Any] = control_suite,
                 policy_network: Callable[..., keras.Model] = d4pg_policy,
                 critic_network: Callable[..., keras.Model] = d4pg_critic,
                 actor_optimizer: Optional[Callable[[], keras.optimizers.Optimizer]] = None,
                 critic_optimizer: Optional[Callable[[], keras.optimizers.Optimizer]] = None,
                 discount: float = 0.99, n_step: int = 5, sigma: float = 0.3,
                 initial_sigma: Optional[float] = None, sigma_decay_steps: int = 0,
                 target_update_period: int = 100, target_update_tau: float = 1.0,
                 samples_per_insert: float = 32.0,
                 min_replay_size: int = 1000, max_replay_size: int = 1_000_000,
                 priority_exponent: float = 0.6, importance_sampling_exponent: float = 0.4,
                 importance_annealing_steps: int = 100_000, dqda_clipping: Optional[float] = 1.0,
                 preactivation_penalty: float = 0.0,
                 eval_episodes: int = 5, num_actors: int = 0, actor_sigmas: Optional[tuple] = None,
                 weights_every: int = 100, max_actor_restarts: int = 2,
                 actor_service_address: str = "127.0.0.1:0", actor_timeout_s: float = 120.0,
                 actor_startup_timeout_s: float = 600.0, max_weight_lag: Optional[int] = None,
                 observation_network: Optional[Callable[..., keras.Model]] = None, actors_per_process: int = 1,
                 lockstep: Optional[bool] = None):
        positive_int = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1  # noqa: E731
        _check("discount", 0.0 <= discount <= 1.0, discount, "must be in [0, 1]")
        _check("n_step", positive_int(n_step), n_step, "must be a positive integer")
        _check("sigma", sigma >= 0, sigma, "must be >= 0")
        _check("initial_sigma", initial_sigma is None or initial_sigma >= 0, initial_sigma, "must be >= 0 or None")
        _check("sigma_decay_steps", initial_sigma is None or positive_int(sigma_decay_steps), sigma_decay_steps,
               "must be a positive integer (learner steps) when D4PGTask.initial_sigma is set")
        _check("target_update_period", positive_int(target_update_period), target_update_period,
               "must be a positive integer")
        _check("target_update_tau", 0.0 < target_update_tau <= 1.0, target_update_tau, "must be in (0, 1]")
        _check("samples_per_insert", samples_per_insert > 0, samples_per_insert, "must be > 0")
        _check("min_replay_size", positive_int(min_replay_size), min_replay_size, "must be a positive integer")
        _check("max_replay_size", positive_int(max_replay_size) and max_replay_size >= min_replay_size,
               max_replay_size, "must be an integer >= D4PGTask.min_replay_size")
        _check("priority_exponent", priority_exponent >= 0, priority_exponent, "must be >= 0")
        _check("importance_sampling_exponent", 0 <= importance_sampling_exponent <= 1,
               importance_sampling_exponent, "must be in [0, 1]")
        _check("importance_annealing_steps", positive_int(importance_annealing_steps),
               importance_annealing_steps, "must be a positive integer")
        _check("dqda_clipping", dqda_clipping is None or dqda_clipping > 0, dqda_clipping, "must be > 0 or None")
        _check("preactivation_penalty", preactivation_penalty >= 0, preactivation_penalty, "must be >= 0")
        _check("eval_episodes", positive_int(eval_episodes), eval_episodes, "must be a positive integer")
        self._environment_fn = environment
        self._policy_fn, self._critic_fn = policy_network, critic_network
        self._observation_network_fn = observation_network
        self._actor_optimizer_fn = actor_optimizer or (lambda: keras.optimizers.Adam(1e-4))
        self._critic_optimizer_fn = critic_optimizer or (lambda: keras.optimizers.Adam(1e-4))
        self.discount, self.n_step, self.sigma = discount, n_step, sigma
        self.exploration = ExplorationSchedule(initial_sigma, sigma_decay_steps)
        self.target_update_period, self.target_update_tau = target_update_period, float(target_update_tau)
        self.samples_per_insert = float(samples_per_insert)
        self.min_replay_size, self.max_replay_size = min_replay_size, max_replay_size
        self.priority_exponent = priority_exponent
        self.beta0, self.annealing_steps = float(importance_sampling_exponent), importance_annealing_steps
        self.dqda_clipping, self.preactivation_penalty = dqda_clipping, float(preactivation_penalty)
        self.eval_episodes = eval_episodes
        _check("num_actors", isinstance(num_actors, int) and num_actors >= 0, num_actors, "must be an integer >= 0")
        _check("actor_sigmas", actor_sigmas is None or (len(actor_sigmas) == num_actors
                                                        and all(s >= 0 for s in actor_sigmas)),
               actor_sigmas, f"must list num_actors={num_actors} sigmas >= 0 (or be None)")
        _check("weights_every", positive_int(weights_every), weights_every, "must be a positive integer")
        _check("actors_per_process", positive_int(actors_per_process), actors_per_process,
               "must be a positive integer")
        self.num_actors, self.weights_every = num_actors, weights_every
        # The actor service holds up to MAX_HELD_INSERTS inserts, and in lockstep one weights
        # request per actor, each on a TensorFlow inter-op thread, while the learner steps.
        self.host_threads = MAX_HELD_INSERTS + num_actors if num_actors else 0
        self.actors_per_process = actors_per_process
        self.actor_sigmas = tuple(actor_sigmas) if actor_sigmas is not None else (sigma,) * num_actors
        self.max_actor_restarts, self.actor_service_address = max_actor_restarts, actor_service_address
        self.actor_timeout_s = actor_timeout_s
        _check("actor_startup_timeout_s", actor_startup_timeout_s > 0, actor_startup_timeout_s, "must be > 0")
        self.actor_startup_timeout_s = float(actor_startup_timeout_s)
        _check("max_weight_lag", max_weight_lag is None or positive_int(max_weight_lag), max_weight_lag,
               "must be a positive integer (learner steps) or None")
        self.max_weight_lag = max_weight_lag
        self._lockstep_resume = None   # a checkpoint's lockstep state, until the actor pool starts
        _check("lockstep", lockstep in (None, True, False), lockstep, "must be True, False or None")
        self.lockstep = lockstep
        self.actor_pool = None

    # -- set-up ------------------------------------------------------------------------

    def setup(self, replicator, global_batch_size: int, seed: int, deterministic: bool) -> None:
        super().setup(replicator, global_batch_size, seed, deterministic)
        if replicator.coordinator is not None or replicator.num_workers > 1:
            raise xf.ConfigError(
                f"D4PGTask acts in the learner's process (synchronous mode), which needs one host; "
                f"Replicator.target={replicator.target!r} runs several: use 'cpu', 'gpu' or 'tpu'.")
        if replicator.target == "mesh":
            raise xf.ConfigError(
                f"D4PGTask's train step {self.xla_incompatible}, which a DTensor mesh step cannot take "
                f"(Replicator.target='mesh'): use Replicator.target='cpu', 'gpu' or 'tpu'.")
        lockstep = deterministic if self.lockstep is None else self.lockstep
        self._lockstep = bool(self.num_actors and lockstep)
        if self.num_actors:
            _check_actor_reproducibility(self.num_actors, deterministic, lockstep, self.weights_every, self.n_step)
        env_seed, eval_seed, replay_seed, noise_seed = np.random.SeedSequence(seed).generate_state(4)
        self._eval_seed = int(eval_seed)
        # With actor processes the learner does not act: no acting environment of its own (for
        # pixels no idle render worker); the evaluation environment gives the shapes.
        acting = None if self.num_actors else self._environment_fn(seed=int(env_seed))
        self.eval_environment = self._environment_fn(seed=int(eval_seed))
        self.environment = acting if acting is not None else self.eval_environment
        (shape, dtype), act = experience.observation_spec(self.environment), self.environment.action_size
        # State features: whole transitions; pixels: each frame once (expframe/rl/experience.py).
        self.replay = experience.make_replay(self.environment, self.max_replay_size, self.n_step, self.discount,
                                             self.priority_exponent, int(replay_seed))
        # The actor's own policy copy lives outside the replicator (plain variables).
        executor = PolicyExecutor(self.make_acting_policy(self.environment), shape)
        self.actor = SynchronousActor(acting, executor,
                                      experience.make_adder(self.replay, self.n_step, self.discount),
                                      sigma=self.sigma, seed=int(noise_seed))
        b = self.per_replica_batch_size
        self.inputs = PreparedBatches({
            "observation": ((b,) + shape, dtype), "action": ((b, act), tf.float32), "reward": ((b,), tf.float32),
            "discount": ((b,), tf.float32), "next_observation": ((b,) + shape, dtype),
            "weight": ((b,), tf.float32), "key": ((b,), tf.int64)})
        self._received, self._lock = [], threading.Lock()
        self._in_flight = None
        self._learner_time, self._learner_steps_timed, self._call_started = 0.0, 0, None
        self._timed_calls = 0
        self._recent_returns = []
        self._remote_episodes = 0  # episodes the actor processes finished (reported with their returns)
        # Weight lag (learner steps) -> transitions inserted at it, since the run started (acting
        # in this process: restored from the checkpoint) or this process did (actor processes):
        # the trainer logs the metrics of the host call that ends a log interval only, so
        # the counts are cumulative, not per call (which would drop all calls but one).
        self._lags: collections.Counter = collections.Counter()

    def build(self) -> None:
        self.observation_network, self.target_observation_network = self._observation_networks(_replica_local)
        obs, act = self._feature_size(self.observation_network), self.environment.action_size
        self.policy = self._policy_fn(observation_size=obs, action_size=act)
        self.critic = self._critic_fn(observation_size=obs, action_size=act)
        with tf.variable_creator_scope(_replica_local):
            self.target_policy = self._policy_fn(observation_size=obs, action_size=act)
            self.target_critic = self._critic_fn(observation_size=obs, action_size=act)
        self.support = tf.constant(self.critic.support)
        self._policy_with_preactivation = self._preactivation_model() if self.preactivation_penalty else None
        with gin.config_scope("actor"):
            self.actor_optimizer = xf.wrap_optimizer(self._actor_optimizer_fn())
        with gin.config_scope("critic"):
            self.critic_optimizer = xf.wrap_optimizer(self._critic_optimizer_fn())
        self.actor_optimizer.build(self.policy.trainable_variables)
        self.critic_optimizer.build(self._critic_variables())
        self.acting_state = _ActingState(self)

    def trackables(self) -> Dict[str, Any]:
        out = {"policy": self.policy, "critic": self.critic, "target_policy": self.target_policy,
               "target_critic": self.target_critic, "actor_optimizer": self.actor_optimizer,
               "critic_optimizer": self.critic_optimizer, "acting": self.acting_state}
        if self.observation_network is not None:
            out.update(observation_network=self.observation_network,
                       target_observation_network=self.target_observation_network)
        return out

    def train_input_fn(self, ctx: tf.distribute.InputContext) -> tf.data.Dataset:
        return self.inputs.dataset()

    # -- the learner step (replica context) ----------------------------------------------

    def _update_targets(self) -> None:
        def move(tau):
            pairs = [(self.policy, self.target_policy), (self.critic, self.target_critic)]
            if self.observation_network is not None:
                pairs.append((self.observation_network, self.target_observation_network))
            for network, target in pairs:
                for source, variable in zip(network.variables, target.variables, strict=True):
                    if tau == 1.0 or not tf.as_dtype(variable.dtype).is_floating:
                        variable.assign(source)
                    else:
                        variable.assign(tau * source + (1.0 - tau) * variable)
            return tf.constant(True)

        # The critic optimizer's update count is the learner step (read before this step's update).
        steps, tau = self.critic_optimizer.iterations, self.target_update_tau
        due = steps % self.target_update_period == 0
        if tau == 1.0:
            tf.cond(due, lambda: move(1.0), lambda: tf.constant(False))
        else:  # step 0 copies; later updates move a fraction tau of the way
            tf.cond(steps == 0, lambda: move(1.0),
                    lambda: tf.cond(due, lambda: move(tau), lambda: tf.constant(False)))

    def train_step(self, batch) -> Dict[str, tf.Tensor]:
        self._update_targets()
        observations, actions = batch["observation"], batch["action"]
        next_observations = self._encode(batch["next_observation"], self.target_observation_network)
        target_logits = tf.cast(self.target_critic([next_observations, self.target_policy(next_observations)]),
                                tf.float32)
        target = losses.categorical_projection(self.support, tf.nn.softmax(target_logits),
                                               batch["reward"], batch["discount"])
        # Both losses read the weights from before this step's updates (as Acme's learner).
        with tf.GradientTape() as critic_tape:
            observations = self._encode(observations, self.observation_network, training=True)  # critic trains it
            logits = tf.cast(self.critic([observations, actions], training=True), tf.float32)
            cross_entropy, td_error = losses.categorical_td(self.support, logits, target)
            critic_loss = tf.reduce_mean(batch["weight"] * cross_entropy)
            # The networks' regularisation losses (model.losses, e.g. kernel_regularizer=...),
            # each added to the loss of the optimizer that trains it.
            critic_reg = model_losses(self.critic, self.observation_network)
            critic_total = critic_loss if critic_reg is None else critic_loss + critic_reg
        with tf.GradientTape() as actor_tape:
            observations = tf.stop_gradient(observations)
            if self._policy_with_preactivation is None:
                policy_actions = self.policy(observations, training=True)
            else:
                preactivations, policy_actions = self._policy_with_preactivation(observations, training=True)
                preactivation_ms = tf.reduce_mean(tf.square(tf.cast(preactivations, tf.float32)))
            with actor_tape.stop_recording(), tf.GradientTape() as dq_tape:
                dq_tape.watch(policy_actions)
                q_values = self._expected(self.critic([observations, policy_actions]))
            actor_loss = tf.reduce_mean(losses.dpg_loss(q_values, policy_actions, dq_tape, self.dqda_clipping))
            if self._policy_with_preactivation is not None:
                actor_loss += self.preactivation_penalty * preactivation_ms
            actor_reg = model_losses(self.policy)
            actor_total = actor_loss if actor_reg is None else actor_loss + actor_reg
        # minimize scales each loss under loss scaling (mixed_float16), then unscales,
        # averages over replicas, clips and applies. The policy's gradient does not
        # read the critic's weights (dQ/da is fixed above), so the order is free; the
        # critic's variables include a pixel encoder, which only the critic trains.
        self.critic_optimizer.minimize(critic_total, self._critic_variables(), critic_tape)
        self.actor_optimizer.minimize(actor_total, self.policy.trainable_variables, actor_tape)

        tf.numpy_function(self._receive, [batch["key"], td_error], [], stateful=True)
        metrics = {"loss": critic_loss, "critic_loss": critic_loss, "actor_loss": actor_loss,
                   "q_mean": tf.reduce_mean(q_values)}
        if self._policy_with_preactivation is not None:
            metrics["policy_preactivation_rms"] = tf.sqrt(preactivation_ms)
        if critic_reg is not None:
            metrics.update(loss=critic_total, critic_reg_loss=critic_reg)
        if actor_reg is not None:
            metrics["actor_reg_loss"] = actor_reg
        return metrics

    def _preactivation_model(self) -> keras.Model:
        """The policy with its tanh's input as a second output (the same layers and weights)."""
        last = self.policy.layers[-1]
        if getattr(getattr(last, "activation", None), "__name__", None) != "tanh" or not hasattr(self.policy, "inputs"):
            raise xf.ConfigError(
                f"D4PGTask.preactivation_penalty={self.preactivation_penalty!r} needs a functional Keras policy whose "
                f"last layer is a tanh activation (as d4pg_policy's); {self.policy.name!r} ends in {last.name!r}: "
                f"set D4PGTask.preactivation_penalty = 0.")
        return keras.Model(self.policy.inputs, [last.input, self.policy.output], name="policy_with_preactivation")

    def _expected(self, logits):
        return tf.reduce_sum(tf.nn.softmax(tf.cast(logits, tf.float32)) * self.support, axis=-1)

    def _receive(self, keys, td_errors):
        """Host side, called by each replica inside the step: its examples' TD errors."""
        with self._lock:
            self._received.append((keys.copy(), td_errors.astype(np.float64)))

    # -- the host side: acting, sampling, priorities ------------------------------------

    def _env_steps_due(self, learner_steps: int) -> int:
        return self.min_replay_size + math.ceil(learner_steps * self.global_batch_size / self.samples_per_insert)

    def _beta(self, learner_step: int) -> float:
        fraction = min(1.0, learner_step / self.annealing_steps)
        return self.beta0 + fraction * (1.0 - self.beta0)

    def before_train_steps(self, step: int, num_steps: int) -> None:
        if self.num_actors:
            self._act_remotely(step, num_steps)
        else:
            self.actor.update(self.acting_weights())
            self.actor.sigma = self.exploration(step, self.sigma)
            due = self._env_steps_due(step + num_steps) - self.actor.env_steps
            if due > 0:
                self.actor.run(due)
                # Acted with the weights of this very step: a weight lag of 0 learner steps
                # (the same measure as the actor processes', for the same metrics).
                self._lags[0] += due
            self._recent_returns.extend(self.actor.finished_returns())
        if self.replay.size == 0:
            raise xf.RunError("D4PGTask: the replay is empty after acting; raise D4PGTask.min_replay_size.")
        batches, rows, items = [], [], []
        b, replicas = self.per_replica_batch_size, self.replicator.num_replicas
        first_key = step * self.global_batch_size
        for i in range(num_steps):
            sample = self.replay.sample(self.global_batch_size, self._beta(step + i))
            sample["key"] = first_key + i * self.global_batch_size + np.arange(self.global_batch_size)
            rows.append(sample.pop("index"))
            items.append(sample.pop("item"))
            # Replica r of the step takes rows [r*b, (r+1)*b): the input pipeline hands
            # out consecutive elements to replicas 0..R-1.
            batches.append({k: v.reshape((replicas, b) + v.shape[1:]) for k, v in sample.items()})
        self._in_flight = (first_key, np.concatenate(rows), np.concatenate(items))
        self.inputs.put({k: np.concatenate([x[k] for x in batches]) for k in batches[0]})
        self._call_started = time.perf_counter()

    def after_train_steps(self, step: int) -> Optional[Dict[str, float]]:
        elapsed = time.perf_counter() - self._call_started
        first_key, rows, items = self._in_flight
        with self._lock:
            received, self._received = self._received, []
        keys = np.concatenate([k for k, _ in received] or [np.zeros(0, np.int64)])
        td_errors = np.concatenate([t for _, t in received] or [np.zeros(0)])
        order = np.argsort(keys, kind="stable")
        keys, td_errors = keys[order], td_errors[order]
        if not np.array_equal(keys, first_key + np.arange(len(rows))):
            raise xf.RunError(f"D4PGTask: the TD errors of {len(keys)} examples came back for the {len(rows)} "
                              f"sampled at steps {step - len(rows) // self.global_batch_size + 1}..{step}.")
        self.replay.update_priorities(rows, items, td_errors)
        self._in_flight = None
        if self._timed_calls:  # the first host call also traces the step: not counted
            self._learner_time += elapsed
            self._learner_steps_timed += len(rows) // self.global_batch_size
        self._timed_calls += 1
        metrics = {"env_steps": float(self.actor.env_steps), "episodes": float(self.actor.episodes),
                   "replay_size": float(self.replay.size),
                   "env_steps_per_sec": self.actor.timed_steps / max(self.actor.acting_time, 1e-9)}
        if self.exploration.initial is not None:
            metrics["sigma"] = self.exploration(step, self.sigma)
        if self.actor_pool is not None:
            metrics.update(self._remote_metrics(step))
        elif self._lags:
            metrics.update(lag_histogram(self._lags))
        if self._learner_steps_timed:
            metrics["learner_steps_per_sec"] = self._learner_steps_timed / max(self._learner_time, 1e-9)
        if self._recent_returns:
            metrics["train_episode_return"] = float(np.mean(self._recent_returns))
            self._recent_returns = []
        return metrics

    # -- distributed acting (num_actors > 0) ----------------------------------------------

    def _act_remotely(self, step: int, num_steps: int) -> None:
        """Publishes the weights; waits for the transitions the ratio asks for (learner
        waits); lets the actors run at most one host call plus one chunk ahead (actors wait)."""
        if self.actor_pool is None:
            from expframe.rl.actor_pool import ActorPool  # pylint: disable=import-outside-toplevel
            shapes = experience.rpc_fields(self.environment)
            self.actor_pool = ActorPool(self.acting_weights(), shapes, self.num_actors, self.actor_sigmas,
                                        self.seed, self.weights_every, capacity=self.max_replay_size,
                                        max_restarts=self.max_actor_restarts, address=self.actor_service_address,
                                        resume_step=step, acting=f"{__name__}:acting_parts",
                                        weight_names=self.acting_weight_names(),
                                        startup_timeout_s=self.actor_startup_timeout_s,
                                        actors_per_process=self.actors_per_process, lockstep=self._lockstep,
                                        lockstep_state=self._lockstep_resume)
            self._insert_offset, self._learner_wait_s, self._remote_started = self.replay.inserted, 0.0, None
            if self._lockstep_resume:
                # The round grid of the run resumed (rounds count from its first pool's offset).
                self._insert_offset = int(self._lockstep_resume[LOCKSTEP_OFFSET])
                self.actor_pool.service.max_version_lag = int(self._lockstep_resume[LOCKSTEP_MAX_LAG])
            self._lockstep_resume = None
            if self.max_weight_lag is not None and self.max_weight_lag < num_steps:
                raise xf.ConfigError(
                    f"D4PGTask.max_weight_lag={self.max_weight_lag} is below the {num_steps} learner steps of one "
                    f"host call (the weights are published once per call): raise it to {num_steps} or more.")
            self.actor_pool.service.max_lag = self.max_weight_lag
        pool = self.actor_pool
        if self._lockstep:
            self._act_in_lockstep(step, num_steps)
            return
        pool.service.publish(self.acting_weights(), step)   # versions are learner steps
        slack = self.weights_every + self.n_step
        pool.service.allow(self._env_steps_due(step + 2 * num_steps) - self._insert_offset + slack)
        due = self._env_steps_due(step + num_steps)
        started = time.perf_counter()
        while True:
            pool.check()
            experience.ingest(self.replay, pool.service)
            if self.replay.inserted >= due:
                break
            if pool.stopping:
                # Signalled while waiting (e.g. for 32 actors still starting on 2 cores):
                # the trainer checkpoints this step instead of waiting for their transitions.
                raise StopRequested(f"stop signal at step {step}, waiting for the actors' transitions")
            pool.wait_for(due - self.replay.inserted, self.actor_timeout_s)
        self._learner_wait_s += time.perf_counter() - started
        if self._remote_started is None:
            self._remote_started = (time.perf_counter(), self.replay.inserted)
        self._take_remote_returns(pool)

    def _take_remote_returns(self, pool) -> None:
        """The returns of the episodes the actor processes finished since the last call:
        kept for `train_episode_return` and counted for `episodes`."""
        returns = pool.service.take_returns()
        self._remote_episodes += len(returns)
        self._recent_returns.extend(returns)

    def _rounds_due(self, learner_steps: int) -> int:
        """(Lockstep) rounds of actor chunks (one chunk of `weights_every` environment steps
        per actor) that cover the environment steps due by `learner_steps`."""
        due = self._env_steps_due(learner_steps) - self._insert_offset
        return max(0, math.ceil(due / (self.num_actors * self.weights_every)))

    def _act_in_lockstep(self, step: int, num_steps: int) -> None:
        """Publishes the weights of `step` for the rounds the next host call but one needs
        (so the actors act one call ahead, with weights one call old), then takes the rounds
        this call needs, whole and in order (`expframe.rl.lockstep`): the same rows reach
        the replay in the same order in every run, whatever the timing. (Letting the actors
        run one chunk further ahead, as free-running ones may, measured 0.80-0.98 of
        free-running speed against 0.63-0.80 without, under load, but made most chunks two
        calls old: a mean lag of 17.9 learner steps against 7.4, where free-running actors
        average 8.6. The lag stays at one call.)"""
        pool = self.actor_pool
        pool.service.publish(self.acting_weights(), step, rounds=self._rounds_due(step + 2 * num_steps))
        due = self._rounds_due(step + num_steps)
        started = time.perf_counter()
        while True:
            pool.check()
            for actor_id, fields, _, _ in pool.service.take_rounds(due, step):
                experience.add_chunk(self.replay, actor_id, fields)
            if pool.service.lockstep.taken >= due:
                break
            if pool.stopping:
                raise StopRequested(f"stop signal at step {step}, waiting for the actors' transitions")
            pool.wait_for(due, self.actor_timeout_s)
        self._learner_wait_s += time.perf_counter() - started
        if self._remote_started is None:
            self._remote_started = (time.perf_counter(), self.replay.inserted)
        self._take_remote_returns(pool)

    def _remote_metrics(self, step: int) -> Dict[str, float]:
        service = self.actor_pool.service
        since, inserted = self._remote_started
        learned = step * self.global_batch_size
        self._lags.update(service.take_lags())
        # env_steps: transitions the actors sent (the synchronous actor does not act here).
        return {"env_steps": float(self.replay.inserted), "episodes": float(self._remote_episodes),
                "transitions_per_sec": (self.replay.inserted - inserted) / max(time.perf_counter() - since, 1e-9),
                "learner_wait_s": self._learner_wait_s, "actor_refused_inserts": float(service.refused),
                "actors_alive": float(self.actor_pool.alive), "actor_restarts": float(self.actor_pool.restarts),
                "max_weights_version_lag": float(service.max_version_lag),   # learner steps
                "actor_stale_chunks": float(service.stale),
                **lag_histogram(self._lags),
                "actor_startup_s": max(self.actor_pool.startup_s.values(), default=0.0),
                "samples_per_insert": learned / max(self.replay.inserted - self.min_replay_size, 1)}

    def close(self) -> None:
        """Stops the actor processes and the environments' render workers (the trainer's
        caller runs this on every exit path; safe to call twice, or before `setup`)."""
        pool, self.actor_pool = self.actor_pool, None
        try:
            if pool is not None:
                pool.close()
        finally:
            environments = [getattr(self, "environment", None), getattr(self, "eval_environment", None)]
            for environment in {id(e): e for e in environments if e is not None}.values():
                if hasattr(environment, "close"):
                    environment.close()

    # -- evaluation --------------------------------------------------------------------

    def evaluate(self, runner) -> Optional[Dict[str, float]]:
        """Mean undiscounted return of `eval_episodes` episodes of the noiseless policy.

        The evaluation environment is reseeded from (the run's seed, the step evaluated:
        `runner.step`), so an evaluation depends only on its checkpoint and the seed: the
        trainer's, `--mode=eval`'s and a continuous evaluator's agree, in any order."""
        step = getattr(runner, "step", None)
        if step is not None:
            self.eval_environment.reseed(int(np.random.SeedSequence([self._eval_seed, int(step)]).generate_state(1)[0]))
        self.actor.update(self.acting_weights())
        returns = episode_returns(self.eval_environment, self.actor.policy, self.eval_episodes)
        return {"episode_return": float(np.mean(returns))}

    def serving(self) -> Dict[str, tf.types.experimental.PolymorphicFunction]:
        """'serving_default': the noiseless policy, `observation` (what the actor feeds it,
        `experience.observation_spec`: float32 [None, features] from states, the stacked
        frames uint8 [None, H, W, 3 * frame_stack] from pixels, through the observation
        network) -> `action` float32 [None, action_size] in [-1, 1]; a plain copy of the
        acting policy (`make_acting_policy`, `acting_weights`)."""
        policy = self.make_acting_policy(self.environment)
        policy.set_weights(self.acting_weights())
        shape, dtype = experience.observation_spec(self.environment)

        @tf.function(input_signature=[tf.TensorSpec((None,) + shape, dtype, name="observation")])
        def act(observation):
            return {"action": tf.cast(policy(observation, training=False), tf.float32)}
        return {"serving_default": act}

    def baseline_metrics(self, episodes: int = 10) -> Dict[str, float]:
        """Returns of uniformly random and of zero actions on this task's environment (for
        pixels, the same physics without rendering): the floor a learning result must clear
        (`expframe.reproduce.baseline`; `registry.D4PG_PIXELS`'s threshold)."""
        unrendered = {"pixels": False} if self._environment_fn is control_suite else {}
        return trivial_policy_returns(lambda seed: self._environment_fn(seed=seed, **unrendered),
                                      self.environment.action_size, episodes)

    # -- checkpointed acting state -------------------------------------------------------

    def acting_arrays(self) -> Dict[str, np.ndarray]:
        """The acting state as named numpy arrays (`_ActingState`): `format`, the replay
        (`replay/...`), the actor with its episode in progress, adder and environment
        (`actor/...`) and the weight-lag counts (`lags`: [lag, transitions] rows)."""
        arrays = {"format": np.array(ACTING_STATE_FORMAT, np.int64)}
        arrays.update({f"replay/{k}": v for k, v in self.replay.state().items()})
        arrays.update({f"actor/{k}": v for k, v in self.actor.state().items()})
        arrays["lags"] = np.array(sorted(self._lags.items()), np.int64).reshape(-1, 2)
        if self._lockstep:
            arrays.update(self._lockstep_arrays())
        if self.num_actors:
            arrays[REMOTE_EPISODES] = np.array(self._remote_episodes, np.int64)
        return arrays

    def _lockstep_arrays(self) -> Dict[str, np.ndarray]:
        """Lockstep actors' part of the acting state: the rounds' bookkeeping with each
        actor's state after the last round taken (`Lockstep.snapshot`), the offset the
        rounds count from and the largest lag so far (the metric goes on from it). Before
        the actor pool starts: what a resume restored, if anything."""
        pool = self.actor_pool
        if pool is None:
            return dict(self._lockstep_resume or {})
        self._lags.update(pool.service.take_lags())   # counted so far, as the metrics count them
        with pool.service._lock:  # pylint: disable=protected-access
            arrays = pool.service.lockstep.snapshot()
            arrays[LOCKSTEP_MAX_LAG] = np.array(pool.service.max_version_lag, np.int64)
        # Returns of episodes taken but not logged yet (a stop while waiting for the actors).
        self._take_remote_returns(pool)
        arrays[LOCKSTEP_RETURNS] = np.array(self._recent_returns, np.float64)
        arrays[LOCKSTEP_OFFSET] = np.array(self._insert_offset, np.int64)
        arrays["lags"] = np.array(sorted(self._lags.items()), np.int64).reshape(-1, 2)
        return arrays

    def restore_acting(self, arrays: Dict[str, np.ndarray]) -> None:
        """Loads `acting_arrays()`. Acting in this process continues the saved episode in the
        saved environment (one with `state()` and `restore(state)`, as `control_suite`'s); a
        checkpoint of format 1 (written before the episode and the environment were saved), or
        one of an environment without them, loads too, its episode in progress lost: acting
        starts a new episode, from the acting environment as built (a line says so)."""
        version = int(arrays.get("format", 1))
        if version > ACTING_STATE_FORMAT:
            raise xf.ConfigError(
                f"this checkpoint's D4PG acting state has format {version}, newer than this expframe's "
                f"({ACTING_STATE_FORMAT}): resume it with the expframe that wrote it.")
        self.replay.restore({k[len("replay/"):]: v for k, v in arrays.items() if k.startswith("replay/")})
        continued = self.actor.restore({k[len("actor/"):]: v for k, v in arrays.items() if k.startswith("actor/")})
        if self.num_actors:
            self._remote_episodes = int(arrays.get(REMOTE_EPISODES, 0))  # 0: a checkpoint older than the count
            if self._lockstep and LOCKSTEP_OFFSET in arrays:
                self._lockstep_resume = {k: v for k, v in arrays.items() if k.startswith("lockstep/")}
                self._lags = collections.Counter({int(lag): int(count) for lag, count in arrays["lags"]})
                self._recent_returns = [float(r) for r in arrays[LOCKSTEP_RETURNS]]
            elif self._lockstep and self.replay.inserted:
                print("expframe: this checkpoint holds no lockstep acting state (written by free-running actors, or "
                      "by an older expframe): the actors start afresh, so this resume is not exact", flush=True)
            return
        if "lags" in arrays:
            self._lags = collections.Counter({int(lag): int(count) for lag, count in arrays["lags"]})
        if version < ACTING_STATE_FORMAT:
            print(f"expframe: this checkpoint's D4PG acting state has format {version} (no environment state): "
                  "the episode open at the checkpoint is lost and acting starts a new one, so this resume is "
                  "not exact", flush=True)
        elif not continued and self.actor.env_steps and not hasattr(self.environment, "state"):
            print(f"expframe: the acting environment ({type(self.environment).__name__}) has no state() and "
                  "restore(state): the episode open at the checkpoint is lost and acting starts a new one, so this "
                  "resume is not exact", flush=True)


def _check_actor_reproducibility(num_actors: int, deterministic: bool, lockstep: bool, weights_every: int,
                                 n_step: int) -> None:
    """Free-running actor processes act with whichever weights were published last, and the
    learner takes whatever actor data has arrived: their runs do not repeat, and one line
    says so. Asked to repeat (deterministic), the actors act in lockstep
    (`expframe.rl.lockstep`), which needs every chunk to carry at least one transition;
    deterministic with lockstep turned off is refused, as PyTorch's
    use_deterministic_algorithms refuses a nondeterministic path."""
    if deterministic and not lockstep:
        raise xf.ConfigError(
            f"run_experiment.deterministic = True with D4PGTask.lockstep = False and D4PGTask.num_actors = "
            f"{num_actors}: free-running actors act with whichever weights were published last, so the run would "
            "not repeat; leave D4PGTask.lockstep unset (None) or turn run_experiment.deterministic off.")
    if not lockstep:
        print(f"expframe: D4PG with {num_actors} free-running actor process(es) is not bit-reproducible: acting "
              "follows the timing of the weight updates (run_experiment.deterministic = True runs the actors in "
              "lockstep with the learner, reproducibly).", flush=True)
        return
    if weights_every < n_step:
        raise xf.ConfigError(
            f"D4PGTask.weights_every={weights_every} is below D4PGTask.n_step={n_step}: acting in lockstep "
            "(run_experiment.deterministic = True or D4PGTask.lockstep = True) counts chunks of weights_every "
            f"environment steps, and a chunk that short can carry no transition; raise D4PGTask.weights_every to "
            f"{n_step} or more.")
    print(f"expframe: D4PG's {num_actors} actor process(es) act in lockstep with the learner: the weights each "
          "chunk acts with and the chunks each learner step takes are fixed by the step count, not by timing.",
          flush=True)


def acting_parts(environment_seed: int):
    """What an actor process acts in and with (`expframe.rl.actor_process --acting`): the
    gin-configured `D4PGTask`'s environment, seeded `environment_seed`, its acting policy
    (observation network and policy, taking `acting_weights()`), n_step and discount."""
    from expframe.rl.actor_process import ActingParts  # pylint: disable=import-outside-toplevel
    task = D4PGTask()
    environment = task._environment_fn(seed=environment_seed)  # pylint: disable=protected-access
    return ActingParts(environment, task.make_acting_policy(environment), task.n_step, task.discount,
                       task.exploration)


# 2: the episode in progress, the environment's state and the weight-lag counts (exact resume);
# 1 (no `format` entry): the replay and the actor's counters and noise only. Lockstep actor
# runs add `lockstep/...` (expframe.rl.lockstep.Lockstep.snapshot, the offset and largest lag).
ACTING_STATE_FORMAT = 2
LOCKSTEP_OFFSET = "lockstep/insert_offset"
REMOTE_EPISODES = "remote_episodes"  # episodes the actor processes finished, for the `episodes` metric
LOCKSTEP_MAX_LAG = "lockstep/max_version_lag"
LOCKSTEP_RETURNS = "lockstep/episode_returns"


class _ActingState(tf.train.experimental.PythonState):
    """The replay, the actor's and the acting environment's state in a checkpoint (numpy's
    .npz format, no pickle; the same state gives the same bytes)."""

    def __init__(self, task: D4PGTask):
        self._task = task

    def serialize(self) -> bytes:
        return npz_bytes(self._task.acting_arrays())

    def deserialize(self, string_value) -> None:
        self._task.restore_acting(npz_arrays(string_value))
