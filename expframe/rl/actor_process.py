"""An actor process: acts with the learner's latest policy and sends it transitions over RPC.

The learner (`D4PGTask` with `num_actors > 0`) starts these; by hand, for actors on
other hosts (the learner's service bound to an address they can reach):

  python -m expframe.rl.actor_process --address=LEARNER_HOST:PORT --actor_id=3 --seed=0 \
      --sigma=0.3 --gin_config=run/operative_config.gin [--restart=1] [--resume_step=STEP]

Seeds: environment and noise from `actor_seeds(seed, actor_id, restart, resume_step)`
(`--seed` is the run's seed): give a restarted actor a new `--restart` and the actors
of a resumed learner its `--resume_step`, or they repeat their episodes and noise.

Loop: fetch the latest weights (`weights`), take `weights_every` environment steps
with them (a `SynchronousActor` writing n-step transitions into a local buffer),
send the buffer (`insert`, retried while the learner refuses: its replay is full or
the samples-per-insert ratio holds actors back), repeat. So the weights acted with
are never older than `weights_every` steps plus one fetch; each insert carries the
version acted with. Exits 0 when the learner closes the service, 1 when it cannot
be reached (the learner is gone) or its parent process has died.
"""

import argparse
import os
import sys
import time
from typing import Dict, List, Optional

import numpy as np

from expframe.atomic_files import write_json


class TransitionBuffer:
    """Collects transitions as a replay would (`add(**fields)`), for sending in one call."""

    def __init__(self):
        self.rows: List[Dict[str, np.ndarray]] = []

    def add(self, **fields: np.ndarray) -> None:
        self.rows.append(fields)

    def drain(self) -> Dict[str, np.ndarray]:
        rows, self.rows = self.rows, []
        from expframe.rl.rpc import FIELDS  # pylint: disable=import-outside-toplevel
        return {f: np.stack([np.asarray(r[f], np.float32) for r in rows]) for f in FIELDS}


class ProcessActor:
    """Runs one actor against a learner's service (see module docstring).

    Args:
      client: an `ActorClient`.
      actor: a `SynchronousActor` whose adder writes into `buffer`.
      buffer: the `TransitionBuffer` behind the actor's adder.
      weights_every: environment steps between weight fetches (and inserts).
    """

    def __init__(self, client, actor, buffer: TransitionBuffer, weights_every: int):
        self.client, self.actor, self.buffer = client, actor, buffer
        self.weights_every = int(weights_every)
        self.weight_wait_s = 0.0      # time spent fetching weights
        self.insert_wait_s = 0.0      # time spent sending (and waiting to be let in)
        self.fetches = 0

    def step(self) -> bool:
        """One fetch, `weights_every` steps, one insert; False once the learner has closed."""
        started = time.perf_counter()
        version, weights = self.client.weights()
        self.weight_wait_s += time.perf_counter() - started
        self.fetches += 1
        if version < 0:
            return False
        self.actor.update(weights)
        self.actor.run(self.weights_every)
        returns = self.actor.finished_returns()
        if not self.buffer.rows:
            return True
        transitions = self.buffer.drain()
        started, delay = time.perf_counter(), 0.001
        while True:
            accepted = self.client.insert(version, transitions, returns)
            if accepted != 0:
                break
            # Refused: the service held it insert_wait_s without room appearing (the
            # learner has not let this many in yet). Retry soon: the next try is held again.
            time.sleep(delay)
            delay = min(delay * 2, 0.01)
        self.insert_wait_s += time.perf_counter() - started
        return accepted > 0

    def stats(self) -> Dict[str, float]:
        return {"env_steps": self.actor.env_steps, "acting_s": self.actor.acting_time,
                "weight_wait_s": self.weight_wait_s, "insert_wait_s": self.insert_wait_s, "fetches": self.fetches}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the learner's service, host:port")
    parser.add_argument("--actor_id", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True, help="the run's seed")
    parser.add_argument("--restart", type=int, default=0, help="how many times this actor was restarted")
    parser.add_argument("--resume_step", type=int, default=0, help="the learner step the learner started from")
    parser.add_argument("--sigma", type=float, required=True, help="exploration noise of this actor")
    parser.add_argument("--weights_every", type=int, default=100, help="environment steps between weight fetches")
    parser.add_argument("--gin_config", required=True, help="the learner's gin config (environment, networks)")
    parser.add_argument("--stats_file", default=None, help="JSON of timings written at exit")
    args = parser.parse_args(argv)

    import gin  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    from expframe import config  # pylint: disable=import-outside-toplevel
    from expframe.rl.actors import PolicyExecutor, SynchronousActor, actor_seeds  # pylint: disable=import-outside-toplevel
    from expframe.rl.experience import actor_buffer, observation_spec  # pylint: disable=import-outside-toplevel
    from expframe.rl.rpc import ActorClient  # pylint: disable=import-outside-toplevel
    from expframe.tasks.d4pg import D4PGTask  # pylint: disable=import-outside-toplevel

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    config.register_symbols()
    with gin.unlock_config():
        gin.parse_config_file(args.gin_config, skip_unknown=True)
    task = D4PGTask()
    env_seed, noise_seed = actor_seeds(args.seed, args.actor_id, args.restart, args.resume_step)
    environment = task._environment_fn(seed=env_seed)  # pylint: disable=protected-access
    # Transitions (state features) or steps with frames (pixels): expframe/rl/experience.py.
    buffer, adder = actor_buffer(environment, task.n_step, task.discount)
    executor = PolicyExecutor(task.make_acting_policy(environment), observation_spec(environment)[0])
    actor = SynchronousActor(environment, executor, adder, sigma=args.sigma, seed=noise_seed)
    runner, parent, code = None, os.getppid(), 0
    try:
        runner = ProcessActor(ActorClient(args.address, args.actor_id), actor, buffer, args.weights_every)
        while runner.step():
            if os.getppid() != parent:
                print(f"actor {args.actor_id}: the learner process is gone; stopping", file=sys.stderr)
                code = 1
                break
    except tf.errors.OpError as error:
        print(f"actor {args.actor_id}: the learner at {args.address} does not answer "
              f"({type(error).__name__}); stopping", file=sys.stderr)
        code = 1
    if args.stats_file and runner is not None:
        write_json(args.stats_file, runner.stats(), indent=None)
    return code


if __name__ == "__main__":
    sys.exit(main())
