"""This machine's synchronised batch norm, timed: what one SyncBatchNorm layer's
collectives (an all-gather of its moments forward, its gradient backward) add to a
training step on N logical CPU replicas or N worker processes on 127.0.0.1.

    python -m expframe.plan.collective_probe --replicas=4          # logical CPU replicas
    python -m expframe.launch --workers=2 -- python -m expframe.plan.collective_probe --multi_worker

A traced chain of `--chain` SyncBatchNorm layers (each needs the last: one collective at
a time), forward and backward on 4 examples of 64 channels per replica, against the same
chain of plain BatchNormalization layers; the difference of their medians over
`--repeats` runs, per layer, is one layer's collectives (`sync_layer_s`). Prints one
JSON line: {"target", "replicas", "sync_layer_s", "plain_layer_s"}.

`measure(kind, n)` runs it in a process of its own (logical devices are set before
TensorFlow starts; workers need a cluster); the planner's hardware 'cpu' uses it for the
configurations it is asked about (`planner.with_sync_probe`).
"""

import argparse
import json
import os
import statistics
import sys
import time

from expframe import processes

CHANNELS = 64

def _probe(target: str, replicas, chain: int, repeats: int) -> dict:
    import keras  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    import expframe as xf  # pylint: disable=import-outside-toplevel
    from expframe.layers.sync_batch_norm import SyncBatchNorm  # pylint: disable=import-outside-toplevel

    rep = xf.Replicator(target, replicas)
    with rep.scope():
        chains = {"sync": [SyncBatchNorm() for _ in range(chain)],
                  "plain": [keras.layers.BatchNormalization() for _ in range(chain)]}

    def make(layers):
        def replica_fn():
            x = tf.random.stateless_normal([4, CHANNELS], seed=[1, 2])
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = x
                for layer in layers:      # each needs the last: one collective at a time
                    y = layer(y, training=True)
                loss = tf.reduce_sum(y * y)
            return tape.gradient(loss, x)

        @tf.function
        def run():
            return rep.run(replica_fn)
        return run

    seconds = {}
    for name, layers in chains.items():
        run = make(layers)
        rep.local_results(run())   # builds, traces and warms up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            rep.local_results(run())
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times) / chain
    return {"target": target, "replicas": rep.num_replicas,
            "sync_layer_s": max(0.0, seconds["sync"] - seconds["plain"]), "plain_layer_s": seconds["plain"]}


def measure(kind: str, n: int, chain: int = 8, repeats: int = 5, timeout: float = 600.0) -> float:
    """Seconds one SyncBatchNorm layer's collectives add to a step on `n` logical CPU
    replicas (kind 'cpu') or `n` worker processes on 127.0.0.1 (kind 'workers'), measured
    in processes of their own."""
    if n <= 1:
        return 0.0
    probe = [sys.executable, "-m", "expframe.plan.collective_probe", f"--chain={chain}", f"--repeats={repeats}"]
    if kind == "cpu":
        command = probe + [f"--replicas={n}"]
    else:
        command = [sys.executable, "-m", "expframe.launch", f"--workers={n}", "--"] + probe + ["--multi_worker"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    # Through this process's owner: its timeout, Ctrl-C or a SIGKILL of this process ends
    # the probe's whole group (a launcher and its workers included).
    done = processes.run(command, f"collective probe ({kind} x {n})", env=env, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if '"sync_layer_s"' in line]
    if done.returncode or not lines:
        raise RuntimeError(f"collective probe ({kind} x {n}) failed ({done.returncode}): {done.stdout.strip()[-400:]}")
    # Under the launcher each worker prints its own line ("[worker i] {...}"): the slowest counts.
    return max(json.loads(line[line.index("{"):])["sync_layer_s"] for line in lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="logical CPU replicas (target 'cpu')")
    parser.add_argument("--multi_worker", action="store_true", help="one replica per worker (TF_CONFIG's cluster)")
    parser.add_argument("--chain", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.multi_worker:
        result = _probe("multi_worker", None, args.chain, args.repeats)
    else:
        result = _probe("cpu", args.replicas, args.chain, args.repeats)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
