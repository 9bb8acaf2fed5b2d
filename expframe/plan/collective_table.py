"""Every collective one train step makes, per family, read from the traced step.

    python -m expframe.plan.collective_table --replicas=2,16            # JSON, one line per count
    python -m expframe.plan.collective_table --replicas=2,16 --markdown # the table in docs/planning.md

Each family's own Task (ClassificationTask with a SyncBatchNorm ResNet, GANTask with the
SN-GAN generator and discriminator, D4PGTask on cartpole), small, is built on N logical
CPU replicas and its `train_step` traced through `Replicator.run` (nothing runs); every
collective of the traced step is read from its graph (`replicator.collective_audit`:
expframe's own collective ops, both branches of a cond, the gradient functions) with
the strategy's reductions recorded while tracing. A process splits its CPU once, so
each replica count runs in a process of its own (this module's command line).

The mesh family (DTensor, `Replicator.mesh_shape`) is not traced here: DTensor inserts
its collectives when it expands the step over the mesh, after tracing, so its graph
holds none to read. docs/planning.md gives its collectives from its layouts.
"""

import argparse
import functools
import json
import re
import sys
from typing import Dict, List, Sequence

FAMILIES = ("classification", "sngan", "d4pg")
_IMAGE = 16


def _images(split, ctx, batch_size, training, seed=0, deterministic=False, num_classes=3, size=_IMAGE):
    """A small in-memory image dataset with the signature of the data configurables."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    del split, ctx, seed, deterministic
    rng = np.random.default_rng(0)
    images = rng.uniform(-1, 1, size=(64, size, size, 3)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices({"image": images, "label": np.arange(64, dtype=np.int32) % num_classes})
    return (ds.repeat() if training else ds).batch(batch_size, drop_remainder=training)


def build(family: str, replicas: int, per_replica_batch: int = 2):
    """(replicator, task) of `family`, small, set up and built on `replicas` CPU replicas."""
    # pylint: disable=import-outside-toplevel
    import keras

    import expframe as xf
    if family == "classification":
        from expframe.models.resnet import resnet
        from expframe.tasks.classification import ClassificationTask
        task = ClassificationTask(
            model=functools.partial(resnet, depth=8, num_classes=3, input_shape=(_IMAGE, _IMAGE, 3),
                                    norm=xf.layers.SyncBatchNorm),
            dataset=_images, optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    elif family == "sngan":
        from expframe.models import sngan
        from expframe.tasks.gan import GANTask
        task = GANTask(generator=functools.partial(sngan.sngan_generator, ch=2, z_dim=8, widths=(2, 2, 1, 1)),
                       discriminator=functools.partial(sngan.sngan_discriminator, ch=1),
                       dataset=functools.partial(_images, size=32), image_size=32, num_classes=3, disc_steps=1,
                       feature_network=None)
    elif family == "d4pg":
        from expframe.models.d4pg import d4pg_critic, d4pg_policy
        from expframe.rl.environments import control_suite
        from expframe.tasks.d4pg import D4PGTask
        task = D4PGTask(environment=functools.partial(control_suite, name="cartpole/balance"),
                        policy_network=functools.partial(d4pg_policy, layer_sizes=(16, 8)),
                        critic_network=functools.partial(d4pg_critic, layer_sizes=(16, 8), num_atoms=11,
                                                         v_min=-20.0, v_max=20.0),
                        actor_optimizer=lambda: keras.optimizers.Adam(1e-3),
                        critic_optimizer=lambda: keras.optimizers.Adam(1e-3), n_step=3, min_replay_size=10)
    else:
        raise ValueError(f"family {family!r}: one of {', '.join(FAMILIES)}")
    replicator = xf.Replicator(target="cpu", num_replicas=replicas)
    task.setup(replicator, per_replica_batch * replicas, 0, False)
    with replicator.scope():
        task.build()
    return replicator, task


def _kind(name: str, elements: int, gradients: Sequence[int]) -> str:
    """What a collective op is for, from its name scope (and size)."""
    from expframe.layers import cross_replica_moments as m  # pylint: disable=import-outside-toplevel

    def within(scope):  # the scope, as TensorFlow makes it unique (scope_1, scope_2, ...)
        return re.search(rf"(^|/){scope}(_\d+)?/", name) is not None
    if within(m.GRADIENTS):
        return "SyncBatchNorm backward: d mean, d var (2C)"
    if within(m.SQUARES):
        return "SyncBatchNorm forward, far shift only: squares about the mean (C)"
    if within(m.SUMS):
        return "SyncBatchNorm forward: count, shifted sums (2C + 1)"
    if elements in gradients:
        return "gradients of one update (parameters)"
    return "other"


def audit(family: str, replicas: int) -> Dict:
    """{'family', 'replicas', 'per_replica': {'elements', 'bytes', 'ops'}, 'collectives':
    [{'kind', 'elements', 'count'} per replica], 'parameters': [trained elements per network]}."""
    # pylint: disable=import-outside-toplevel
    import tensorflow as tf

    from expframe.plan import measure
    from expframe.replicator import collective_audit
    replicator, task = build(family, replicas)
    spec = measure._spec(task.train_input_fn(tf.distribute.InputContext()))  # noqa: SLF001 (the planner's)
    step = tf.function(lambda element: replicator.run(task.train_step, element))
    with collective_audit.recording_strategy_reductions() as reductions:
        graph = step.get_concrete_function(spec).graph
    ops = collective_audit.traced_collectives(graph)
    networks = [m for m in task.trackables().values() if hasattr(m, "trainable_variables")
                and hasattr(m, "layers")]
    gradients = sorted({sum(v.shape.num_elements() for v in m.trainable_variables) for m in networks} - {0})
    kinds: Dict[tuple, int] = {}
    for op in ops:
        key = (_kind(op["name"], op["elements"], gradients), op["elements"], op["group_size"])
        kinds[key] = kinds.get(key, 0) + 1
    rows = [{"kind": k, "elements": e, "group_size": g, "count": c / replicas}
            for (k, e, g), c in sorted(kinds.items())]
    rows += [{"kind": f"strategy reduction ({r['op']})", "elements": r["elements"], "group_size": None, "count": 1}
             for r in reductions]
    return {"family": family, "replicas": replicas,
            "per_replica": collective_audit.per_replica_elements(ops, reductions, replicas),
            "collectives": rows, "parameters": gradients}


_FORMULA = {
    "gradients of one update (parameters)": "P, the update's parameters",
    "SyncBatchNorm forward: count, shifted sums (2C + 1)": "2C + 1 per call",
    "SyncBatchNorm forward, far shift only: squares about the mean (C)": "C per call, first steps only",
    "SyncBatchNorm backward: d mean, d var (2C)": "2C per differentiated call",
}


def summary(result: Dict) -> Dict[str, Dict]:
    """kind -> {'calls', 'elements'} per replica and step, over the kind's collectives."""
    out: Dict[str, Dict] = {}
    for row in result["collectives"]:
        got = out.setdefault(row["kind"], {"calls": 0.0, "elements": 0.0})
        got["calls"] += row["count"]
        got["elements"] += row["count"] * row["elements"]
    return out


def sync_bn_net(replicas: int, group_size=None, norm=None) -> Dict:
    """The issue's conv net (two SyncBatchNorm layers, 64 and 128 channels) on `replicas`
    CPU replicas: its traced step's collectives from batch norm, per replica ({'elements',
    'steady'}: every traced collective and strategy reduction (a group's averaged moving
    statistics), and those the steady state runs: not the far branch). `norm`: another
    batch-norm class (a benchmark's)."""
    # pylint: disable=import-outside-toplevel
    import keras
    import tensorflow as tf

    import expframe as xf
    from expframe.replicator import collective_audit
    norm = norm or xf.layers.SyncBatchNorm
    replicator = xf.Replicator(target="cpu", num_replicas=replicas)
    with replicator.scope():
        model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(64, 3, padding="same"),
                                  norm(group_size=group_size), keras.layers.ReLU(),
                                  keras.layers.Conv2D(128, 3, padding="same"), norm(group_size=group_size),
                                  keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])

    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)  # no optimizer: batch norm's collectives only

    with collective_audit.recording_strategy_reductions() as reductions:
        graph = tf.function(lambda x: replicator.run(step, x)).get_concrete_function(
            tf.TensorSpec([2, 8, 8, 3])).graph
    ops = collective_audit.traced_collectives(graph)
    far = [o for o in ops if _kind(o["name"], o["elements"], []).startswith("SyncBatchNorm forward, far")]
    averaged = sum(r["elements"] for r in reductions)
    return {"replicas": replicas, "group_size": group_size,
            "elements": sum(o["elements"] for o in ops) / replicas + averaged,
            "steady": sum(o["elements"] for o in ops if o not in far) / replicas + averaged}


def markdown(results: List[Dict]) -> str:
    """The per-family table of docs/planning.md from `audit` results at several counts."""
    counts = sorted({r["replicas"] for r in results})
    lines = ["| family | collective of one train step | elements per replica | calls per step | "
             + " | ".join(f"N = {n}" for n in counts) + " |", "|" + "---|" * (4 + len(counts))]
    for family in FAMILIES:
        by_n = {r["replicas"]: summary(r) for r in results if r["family"] == family}
        totals = {r["replicas"]: r["per_replica"] for r in results if r["family"] == family}
        if not by_n:
            continue
        first = by_n[counts[0]]
        for kind in sorted(first, key=lambda k: (k.startswith("SyncBatchNorm"), k)):
            cells = " | ".join(f"{by_n[n][kind]['elements']:,.0f}" if kind in by_n.get(n, {}) else "-"
                               for n in counts)
            lines.append(f"| {family} | {kind} | {_FORMULA.get(kind, '')} | {first[kind]['calls']:g} | {cells} |")
        cells = " | ".join(f"**{totals[n]['elements']:,.0f}**" if n in totals else "-" for n in counts)
        lines.append(f"| {family} | **all, per replica** | | {totals[counts[0]]['ops']:g} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="2", help="comma-separated replica counts; each in its own process")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--markdown", action="store_true", help="print the table (runs a process per count)")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.replicas.split(",")]
    families = [f for f in args.families.split(",") if f]
    if len(counts) == 1 and not args.markdown:
        import expframe  # pylint: disable=import-outside-toplevel
        expframe.split_cpu(counts[0])
        for family in families:
            print(json.dumps(audit(family, counts[0])), flush=True)
        return 0
    from expframe import processes  # pylint: disable=import-outside-toplevel
    results = []
    for n in counts:
        done = processes.run([sys.executable, "-m", "expframe.plan.collective_table", f"--replicas={n}",
                              f"--families={','.join(families)}"], f"collectives on {n} replicas", check=True)
        results += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if args.markdown:
        print(markdown(results))
    else:
        for r in results:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
