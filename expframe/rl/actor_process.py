"""An actor process: acts with the learner's latest policy and sends it transitions over RPC.

The learner (`D4PGTask` with `num_actors > 0`) starts these; by hand, for actors on
other hosts (the learner's service bound to an address they can reach):

  python -m expframe.rl.actor_process --address=LEARNER_HOST:PORT --actor_id=3 --seed=0 \
      --sigma=0.3 --gin_config=run/operative_config.gin [--restart=1] [--resume_step=STEP]

Seeds: environment and noise from `actor_seeds(seed, actor_id, restart, resume_step)`
(`--seed` is the run's seed): give a restarted actor a new `--restart` and the actors
of a resumed learner its `--resume_step`, or they repeat their episodes and noise. A
learner that runs its actors in lockstep (`expframe.rl.lockstep`) instead gives each
actor the state to start from (`start_state`): a restart continues its predecessor's
episode, noise and environment, and so do the actors of a resumed learner.

What to act in and with comes from `--acting=module:function` (default
`expframe.tasks.d4pg:acting_parts`, what `D4PGTask` passes): called after the gin config
is parsed, with the actor's environment seed, it returns an `ActingParts` (environment,
acting policy, n_step, discount). The learner's gin config is parsed after
`--registry=module:function` (default `expframe.config:register_symbols`, the top floor's
registry) has made its configurables known. The learner names both; rl/ imports neither
(imports run one way: the task and the registry sit above rl/).

Lifetime: started by `ActorPool` in a session of its own, it ignores SIGINT (the terminal's
Ctrl-C is the learner's to handle; the learner closes its service when it has saved what it
needs, and the actor exits). SIGTERM ends it at once; its render worker stops at end of file
on its socket, or by this process's guard.

Several actors in one process (`--actor_id=8,9,10,11 --sigma=0.05,0.1,0.15,0.2`, what
`D4PGTask.actors_per_process` asks the learner to start): each keeps its own id, seeds,
environment (with its render worker), noise and replay stream, and sends under its own
id; they share this process's TensorFlow and one policy, act in lockstep with one
batched policy call per step, and their render workers render at the same time
(`expframe.rl.actors.run_together`). One process of 8 actors imports TensorFlow once
where 8 processes import it 8 times (start-up, memory and steps per second side by side:
`benchmarks/actors_per_process.py`).

Loop: fetch the latest weights (`weights`), take `weights_every` environment steps
with them (a `SynchronousActor` writing n-step transitions into a local buffer),
send the buffer (`insert`, retried while the learner refuses: its replay is full or
the samples-per-insert ratio holds actors back), repeat. So the weights acted with
are never older than `weights_every` steps plus one fetch; each insert carries the
version acted with. Exits 0 when the learner closes the service, 1 when it cannot
be reached (the learner is gone) or its parent process has died.
"""

import argparse
import importlib
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from expframe.atomic_files import write_json

DEFAULT_ACTING = "expframe.tasks.d4pg:acting_parts"
# What makes every configurable of the learner's gin config known (the top floor's registry).
DEFAULT_REGISTRY = "expframe.config:register_symbols"


class ActingParts(NamedTuple):
    """What an actor process acts in and with (what `--acting`'s function returns)."""

    environment: Any        # reset() / step(action) / action_size (expframe/rl/environments.py)
    policy: Any             # a keras.Model from observations to actions, taking the learner's acting weights
    n_step: int
    discount: float
    # (learner step of the weights, the actor's --sigma) -> the sigma to act with; None: --sigma
    exploration: Optional[Callable[[int, float], float]] = None


def load_acting(spec: str) -> Callable[..., Any]:
    """The function `module:function` names (`--acting`, `--registry`); a one-line error if
    it cannot be found."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"error: --acting={spec!r}: {type(error).__name__}: {error} (give module:function)") from None


class ProcessActor:
    """Runs one actor, or several acting together, against a learner's service (see module
    docstring).

    Args:
      client: an `ActorClient`, or one per actor (each sends under its own actor id).
      actor: a `SynchronousActor` whose adder writes into `buffer`; or a list of them
        sharing one `PolicyExecutor`, which act in lockstep (`run_together`).
      buffer: the `expframe.rl.experience.TransitionBuffer` behind the actor's adder (a
        list: one per actor).
      weights_every: environment steps between weight fetches (and inserts).
      exploration: None, or `(version, sigma) -> sigma`: each actor's noise for the
        weights of learner step `version`, from its own sigma at start (DrQ-v2's decay,
        `expframe.rl.exploration`).
      send_state: send each actor's state (`SynchronousActor.state()`, .npz bytes) with
        each chunk, as it is after the chunk (the learner runs its actors in lockstep,
        `expframe.rl.lockstep`, and resumes them from those states).
    """

    def __init__(self, client, actor, buffer, weights_every: int,
                 exploration: Optional[Callable[[int, float], float]] = None, send_state: bool = False):
        many = isinstance(actor, (list, tuple))
        self.clients = list(client) if many else [client]
        self.actors = list(actor) if many else [actor]
        self.buffers = list(buffer) if many else [buffer]
        if not len(self.clients) == len(self.actors) == len(self.buffers) >= 1:
            raise ValueError(f"ProcessActor: {len(self.clients)} clients, {len(self.actors)} actors and "
                             f"{len(self.buffers)} buffers: give one of each per actor.")
        self.weights_every = int(weights_every)
        self.exploration = exploration
        self.send_state = bool(send_state)
        self.final_sigmas = [actor.sigma for actor in self.actors]
        self.weight_wait_s = 0.0      # time spent fetching weights
        self.insert_wait_s = 0.0      # time spent sending (and waiting to be let in)
        self.fetches = 0
        self.stale_chunks = 0         # chunks the learner refused as acted with too old weights

    @property
    def actor(self):
        return self.actors[0]

    def _fetch(self) -> Tuple[int, List[Any]]:
        """The latest weights through the first client. On the first call every client
        fetches once: each actor id is then known to the learner (ready) before it acts."""
        started = time.perf_counter()
        for client in [] if self.fetches else self.clients[1:]:
            if client.weights()[0] < 0:
                return -1, []
        version, weights = self.clients[0].weights()
        self.weight_wait_s += time.perf_counter() - started
        self.fetches += 1
        return version, weights

    def step(self) -> bool:
        """One fetch, `weights_every` steps (of each actor), one insert per actor; False once
        the learner has closed.

        Raises:
          WeightNamesError: (first call) the learner sends other weights than this policy has.
          DuplicateActorError: another live actor sends under one of these actors' ids.
        """
        if not self.fetches:
            from expframe.rl.actors import weight_names  # pylint: disable=import-outside-toplevel
            self.clients[0].check_names(weight_names(self.actor.policy.policy))
        version, weights = self._fetch()
        if version < 0:
            return False
        self.actor.update(weights)   # the policy all the actors share
        if self.exploration is not None:
            for actor, sigma in zip(self.actors, self.final_sigmas, strict=True):
                actor.sigma = self.exploration(version, sigma)
        if len(self.actors) == 1:
            self.actor.run(self.weights_every)
        else:
            from expframe.rl.actors import run_together  # pylint: disable=import-outside-toplevel
            run_together(self.actors, self.weights_every)
        for client, actor, buffer in zip(self.clients, self.actors, self.buffers, strict=True):
            if not self._send(client, version, actor.finished_returns(), buffer, actor):
                return False
        return True

    def _send(self, client, version: int, returns: List[float], buffer, actor) -> bool:
        """Inserts `buffer`'s transitions (with `actor`'s state when `send_state`), retried
        while the learner holds them back; False once the learner has closed."""
        from expframe.rl.npz_state import npz_bytes  # pylint: disable=import-outside-toplevel
        from expframe.rl.rpc import STALE  # pylint: disable=import-outside-toplevel
        if not buffer.rows:
            return True
        transitions = buffer.drain()
        state = npz_bytes(actor.state()) if self.send_state else b""
        started, delay = time.perf_counter(), 0.001
        while True:
            accepted = client.insert(version, transitions, returns, state)
            if accepted == STALE:   # the learner moved too far past these weights: dropped
                self.stale_chunks += 1
                return True
            if accepted != 0:
                break
            # Refused: the service held it insert_wait_s without room appearing (the
            # learner has not let this many in yet). Retry soon: the next try is held again.
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        self.insert_wait_s += time.perf_counter() - started
        return accepted > 0

    def stats(self) -> Dict[str, float]:
        acting = max(actor.acting_time for actor in self.actors)   # together: the same seconds
        return {"env_steps": sum(actor.env_steps for actor in self.actors), "acting_s": acting,
                "weight_wait_s": self.weight_wait_s, "insert_wait_s": self.insert_wait_s, "fetches": self.fetches,
                "actors": len(self.actors)}


def _numbers(text: str, kind):
    """'3' or '3,4,5' -> [3] or [3, 4, 5] (`kind` int or float)."""
    try:
        return [kind(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give one {kind.__name__} or several separated by commas") from None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the learner's service, host:port")
    parser.add_argument("--actor_id", type=lambda t: _numbers(t, int), required=True,
                        help="this actor's id, or several ('8,9,10,11'): actors that act together in this process")
    parser.add_argument("--seed", type=int, required=True, help="the run's seed")
    parser.add_argument("--restart", type=int, default=0, help="how many times this process was restarted")
    parser.add_argument("--resume_step", type=int, default=0, help="the learner step the learner started from")
    parser.add_argument("--sigma", type=lambda t: _numbers(t, float), required=True,
                        help="exploration noise of each actor (as many as --actor_id); with the gin config's "
                             "D4PGTask.initial_sigma, what each actor's noise decays to")
    parser.add_argument("--weights_every", type=int, default=100, help="environment steps between weight fetches")
    parser.add_argument("--gin_config", required=True, help="the learner's gin config (environment, networks)")
    parser.add_argument("--stats_file", default=None, help="JSON of timings written at exit")
    parser.add_argument("--acting", default=DEFAULT_ACTING,
                        help="module:function(environment_seed) -> ActingParts, called after the gin config is parsed")
    parser.add_argument("--registry", default=DEFAULT_REGISTRY,
                        help="module:function() that registers the gin config's configurables")
    args = parser.parse_args(argv)
    ids, sigmas = args.actor_id, args.sigma
    if len(sigmas) != len(ids) or len(set(ids)) != len(ids) or min(ids) < 0:
        parser.error(f"--actor_id={','.join(map(str, ids))} --sigma={','.join(map(str, sigmas))}: give distinct "
                     "ids >= 0 and one sigma per id")
    name = f"actor {ids[0]}" if len(ids) == 1 else f"actors {','.join(map(str, ids))}"
    # The terminal's Ctrl-C is the learner's: it checkpoints, then closes its service (we exit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import gin  # pylint: disable=import-outside-toplevel

    from expframe import tf_noise  # pylint: disable=import-outside-toplevel

    # TensorFlow's start-up notices (CUDA probing, absl's banner) stay out of the learner's
    # output, as main.py keeps them out of its own; the learner's --tf_logs shows them.
    with tf_noise.quiet_start(enabled=os.environ.get("TF_CPP_MIN_LOG_LEVEL") != "0"):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        tf.config.list_physical_devices()

    from expframe.rl.actors import PolicyExecutor, SynchronousActor, actor_seeds  # pylint: disable=import-outside-toplevel
    from expframe.rl.experience import actor_buffer, observation_spec  # noqa: E501  pylint: disable=import-outside-toplevel
    from expframe.rl.rpc import ActorClient, DuplicateActorError, WeightNamesError  # pylint: disable=import-outside-toplevel

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    acting = load_acting(args.acting)
    load_acting(args.registry)()
    with gin.unlock_config():
        gin.parse_config_file(args.gin_config, skip_unknown=True)
    environments, actors, buffers, executor, exploration = [], [], [], None, None
    runner, parent, code = None, os.getppid(), 0
    try:
        for actor_id, sigma in zip(ids, sigmas, strict=True):
            env_seed, noise_seed = actor_seeds(args.seed, actor_id, args.restart, args.resume_step)
            parts = acting(env_seed)
            exploration = parts.exploration
            environments.append(parts.environment)
            # Transitions (state features) or steps with frames (pixels): expframe/rl/experience.py.
            buffer, adder = actor_buffer(parts.environment, parts.n_step, parts.discount)
            # One policy for the actors of this process (they act with the same weights).
            executor = executor or PolicyExecutor(parts.policy, observation_spec(parts.environment)[0])
            actors.append(SynchronousActor(parts.environment, executor, adder, sigma=sigma, seed=noise_seed))
            buffers.append(buffer)
        clients = [ActorClient(args.address, actor_id) for actor_id in ids]
        # In lockstep, a restarted actor (or one of a resumed learner) continues from the
        # state the learner holds for it, not from its fresh seeds.
        lockstep = False
        for client, actor in zip(clients, actors, strict=True):
            lockstep, state = client.start_state()
            if state:
                from expframe.rl.npz_state import npz_arrays  # pylint: disable=import-outside-toplevel
                actor.restore(npz_arrays(state))
        runner = ProcessActor(clients, actors, buffers, args.weights_every, exploration, send_state=lockstep)
        while runner.step():
            if os.getppid() != parent:
                print(f"{name}: the learner process is gone; stopping", file=sys.stderr)
                code = 1
                break
    except tf.errors.OpError as error:
        print(f"{name}: the learner at {args.address} does not answer ({type(error).__name__}); stopping",
              file=sys.stderr)
        code = 1
    except (DuplicateActorError, WeightNamesError) as error:
        print(f"error: {error}", file=sys.stderr)
        code = 2
    finally:
        for environment in environments:
            if hasattr(environment, "close"):
                environment.close()   # a pixel environment's render worker
    if args.stats_file and runner is not None:
        write_json(args.stats_file, runner.stats(), indent=None)
    return code


if __name__ == "__main__":
    sys.exit(main())
