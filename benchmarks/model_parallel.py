"""Model parallelism on a DTensor mesh: memory per device and examples/s, side by side.

    python benchmarks/model_parallel.py            # ViT widths 64 and 256, 30 timed steps each
    python benchmarks/model_parallel.py --quick    # 5 timed steps
    python benchmarks/model_parallel.py --smoke    # width 16, 1 step: that it runs

For the ViT of experiments/vit_shapes_mesh.gin (32x32 images, its replicated conv
stem of 16, 32, 64 channels, a 4x4 token grid, depth 2, MLP 2x width) at two widths,
on meshes batch x model = 4x1 (data parallel), 2x2 and 1x4 (tensor parallel), all
over the same 4 logical CPU devices: the bytes of parameters and of MeshAdam's slots
that ONE device holds (read from its shards), and training examples/s at global
batch 64 (median of timed steps after two warm-up steps). The meshes are timed one
after another in the same process, so the ratios compare like
with like; the absolute rates depend on the machine's load. A table on stdout, and JSON
with `--out`.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import expframe  # noqa: E402

expframe.split_cpu(4)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from expframe.models.vit import ViT  # noqa: E402
from expframe.replicator import mesh  # noqa: E402
from expframe.replicator.mesh_optimizer import MeshAdam  # noqa: E402
from machine import cpu_name, write_result  # noqa: E402  (benchmarks/machine.py)

MESHES = ((4, 1), (2, 2), (1, 4))
WIDTHS = (64, 256)
BATCH = 64


def device_bytes(variables) -> int:
    """Bytes that the first device of the mesh holds of these variables."""
    return sum(int(np.prod(mesh.shard_shapes(v)[0])) * v.dtype.size for v in variables)


def measure(width: int, batch: int, model: int, steps: int) -> dict:
    rep = expframe.Replicator(target="mesh", mesh_shape={"batch": batch, "model": model})
    with rep.scope():
        vit = ViT(num_classes=10, image_size=32, patch_size=8, width=width, depth=2, num_heads=4,
                  mlp_dim=2 * width, seed=0, stem_widths=(16, 32, 64))
        opt = MeshAdam(learning_rate=1e-3)
        opt.build(vit.trainable_variables)

    @tf.function
    def step(images, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, vit(images)))
        opt.apply(tape.gradient(loss, vit.trainable_variables), vit.trainable_variables)
        return loss

    rng = np.random.RandomState(0)
    images = rep.mesh_target.shard(tf.constant(rng.rand(BATCH, 32, 32, 3).astype(np.float32)))
    labels = rep.mesh_target.shard(tf.constant(rng.randint(0, 10, BATCH).astype(np.int32)))
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        with mesh.use_mesh(rep.mesh_target.mesh):
            float(mesh.to_host(step(images, labels)))
        if i >= 2:
            times.append(time.perf_counter() - start)
    slots = [s for group in opt.slots for s in group]
    return {"params_bytes": device_bytes(vit.trainable_variables), "slot_bytes": device_bytes(slots),
            "examples_per_s": BATCH / statistics.median(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 timed steps per configuration")
    parser.add_argument("--smoke", action="store_true", help="width 16, 1 timed step: that it runs (seconds)")
    parser.add_argument("--out", default=None, help="also write the table as JSON here")
    args = parser.parse_args()
    steps = 1 if args.smoke else 5 if args.quick else 30
    widths = (16,) if args.smoke else WIDTHS
    print(f"{cpu_name()}, {os.cpu_count()} cores; 4 logical CPU devices; global batch {BATCH}; "
          f"median of {steps} steps")
    print(f"{'width':>5} {'mesh':>5} {'params/device':>14} {'slots/device':>13} {'examples/s':>11} "
          f"{'vs 4x1':>7}")
    rows = []
    for width in widths:
        base = None
        for batch, model in MESHES:
            r = measure(width, batch, model, steps)
            base = base or r["examples_per_s"]
            rows.append(dict(r, width=width, mesh=f"{batch}x{model}", vs_4x1=r["examples_per_s"] / base))
            print(f"{width:>5} {batch}x{model:<3} {r['params_bytes'] / 1024:>11.1f} KB "
                  f"{r['slot_bytes'] / 1024:>10.1f} KB {r['examples_per_s']:>11.1f} "
                  f"{r['examples_per_s'] / base:>6.2f}x", flush=True)
    if args.out:
        write_result(args.out, {"benchmark": "model_parallel", "cpu": cpu_name(), "cores": os.cpu_count(),
                                "batch": BATCH, "steps": steps, "rows": rows})


if __name__ == "__main__":
    main()
