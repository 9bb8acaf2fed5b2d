"""Bytes of one data-position checkpoint per worker, ResNet-50 ImageNet pipeline (issue 9, item 10).

    python benchmarks/data_checkpoint_size.py            # the real configuration, ~5 min on 2 cores
    python benchmarks/data_checkpoint_size.py --quick    # small images and batch, ~1 min
    python benchmarks/data_checkpoint_size.py --smoke    # that it runs: numbers meaningless

The configuration is `experiments/resnet50_imagenet.gin`'s: `imagenet_input` train split,
224x224 float32 images, global batch 1024, the 10,000-example shuffle buffer; the
examples are TFDS mock data (`imagenet_input.use_mock = True`, random JPEGs with the
real feature spec), enough of them that the shuffle buffer stays full as on ImageNet.
One worker, on 1 and 2 CPU replicas. For each, an iterator is advanced a few steps,
left a few seconds for its prefetch buffers to fill as they do during training, and
then checkpointed; two ways, side by side:

  tfdata_state  `tf.train.Checkpoint(data=<plain tf.data iterator>)`: the full tf.data
                iterator state, which is what expframe wrote before issue 9: the shuffle
                buffer (10,000 encoded JPEGs) and every prefetched batch (decoded
                float32 images) go into it. Measured on `legacy_input_fn`, the train
                pipeline as it was (a shuffle buffer of JPEG bytes).
  position      `tf.train.Checkpoint(data=<DistributedIterator>.position)`: what expframe
                writes now (issue 9): global batches and examples consumed and the
                replica count, three int64. Measured on `imagenet_input` as it is (an
                index-based order: the pipeline restarts at the consumed example). It
                is in the chief's checkpoint only; other workers write nothing.

Mock JPEGs are tiny (a few dozen pixels a side, ~1.7 kB); ImageNet's train JPEGs average
~110 kB (1,281,167 images in the 147.9 GB ILSVRC2012_img_train.tar). The shuffle
buffer's share is extrapolated by replacing the measured mean mock JPEG size with that
(decoded batches are 224x224 whatever the source, so their share is measured as is).

Results: a table on stdout and JSON in `benchmarks/results/data_checkpoint_size.json` (or `--out`).
"""

import argparse
import glob
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import expframe  # noqa: E402

expframe.split_cpu(2)  # before any TensorFlow op: 2 logical CPU devices

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from expframe.data import imagenet  # noqa: E402
from machine import cpu_name, write_result  # noqa: E402  (benchmarks/machine.py)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "data_checkpoint_size.json")
IMAGENET_TRAIN_BYTES = 147_897_477_120  # ILSVRC2012_img_train.tar
IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_MEAN_JPEG = IMAGENET_TRAIN_BYTES / IMAGENET_TRAIN_IMAGES  # ~115 kB, tar headers included


def legacy_input_fn(config):
    """The train pipeline before issue 9 (expframe/data/imagenet.py at commit f0274e8): mock
    examples in memory, a shuffle buffer of encoded JPEGs, a random stream of per-example
    seeds, parallel decode and augmentation, batch, prefetch."""
    def input_fn(ctx):
        seed = 0 + ctx.input_pipeline_id
        images, labels = imagenet._mock_arrays("train", config["mock_examples"], None)
        ds = tf.data.Dataset.from_tensor_slices({"image": list(images), "label": list(labels)})
        ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        ds = ds.shuffle(config["shuffle_buffer"], seed=seed).repeat()
        seeds = tf.data.Dataset.random(seed=seed).batch(2)
        ds = tf.data.Dataset.zip(ds, seeds).map(
            lambda ex, s: {"image": imagenet.preprocess_for_train(ex["image"], s, config["image_size"]),
                           "label": tf.cast(ex["label"], tf.int32)},
            num_parallel_calls=tf.data.AUTOTUNE)
        batch = ctx.get_per_replica_batch_size(config["global_batch"])
        return ds.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    return input_fn


def current_input_fn(config):
    """`imagenet_input` as ClassificationTask calls it under resnet50_imagenet.gin (mock data)."""
    def input_fn(ctx):
        return imagenet.imagenet_input(
            "train", ctx, batch_size=ctx.get_per_replica_batch_size(config["global_batch"]), training=True,
            seed=0, image_size=config["image_size"], shuffle_buffer_size=config["shuffle_buffer"],
            use_mock=True, mock_num_examples=config["mock_examples"])
    return input_fn


def advance(rep, iterator, steps: int, settle_s: float) -> None:
    for _ in range(steps):
        tf.nest.map_structure(lambda t: t.numpy(), rep.local_results(iterator.get_next()))
    time.sleep(settle_s)  # the prefetch buffers refill while a step would run


def checkpoint_bytes(trackable, directory: str, name: str) -> int:
    prefix = tf.train.Checkpoint(data=trackable).write(os.path.join(directory, name))
    return sum(os.path.getsize(p) for p in glob.glob(prefix + ".*"))


def measure(num_replicas: int, config: dict, workdir: str) -> dict:
    rep = expframe.Replicator("cpu", num_replicas=num_replicas)
    started = time.time()
    legacy = iter(rep.distribute(legacy_input_fn(config), config["global_batch"]))
    advance(rep, legacy, config["steps"], config["settle_s"])
    tfdata = checkpoint_bytes(legacy.iterator, workdir, f"tfdata-{num_replicas}")
    del legacy
    current = iter(rep.distribute(current_input_fn(config), config["global_batch"]))
    advance(rep, current, config["steps"], config["settle_s"])
    assert current.index_based and current.position.values()[1] == config["steps"] * config["global_batch"]
    position = checkpoint_bytes(current.position, workdir, f"position-{num_replicas}")
    images, _ = imagenet._mock_arrays("train", config["mock_examples"], None)
    mean_jpeg = float(np.mean([len(i) for i in images]))
    buffer_mock = config["shuffle_buffer"] * mean_jpeg
    decoded_batch = config["global_batch"] * config["image_size"] ** 2 * 3 * 4
    extrapolated = tfdata - buffer_mock + config["shuffle_buffer"] * IMAGENET_MEAN_JPEG
    return {"num_replicas": num_replicas, "workers": 1, "steps_consumed": config["steps"],
            "tfdata_state_bytes": tfdata,
            "tfdata_state_decoded_batches_held": round((tfdata - buffer_mock) / decoded_batch, 2),
            "mock_mean_jpeg_bytes": round(mean_jpeg, 1),
            "tfdata_state_bytes_imagenet_jpegs": int(extrapolated),
            "position_bytes": position,
            "ratio_tfdata_over_position": round(tfdata / position),
            "seconds": round(time.time() - started, 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="64x64 images, batch 64, buffer 1,000")
    parser.add_argument("--smoke", action="store_true", help="32x32 images, batch 8, buffer 64: that it runs")
    parser.add_argument("--out", default=None, help="the JSON file (default benchmarks/results/...)")
    args = parser.parse_args()
    if args.smoke:
        config = {"global_batch": 8, "image_size": 32, "shuffle_buffer": 64, "mock_examples": 128,
                  "steps": 2, "settle_s": 0.2}
    elif args.quick:
        config = {"global_batch": 64, "image_size": 64, "shuffle_buffer": 1_000, "mock_examples": 2_000,
                  "steps": 2, "settle_s": 2.0}
    else:
        config = {"global_batch": 1024, "image_size": 224, "shuffle_buffer": 10_000, "mock_examples": 16_384,
                  "steps": 2, "settle_s": 10.0}
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        imagenet._mock_arrays("train", config["mock_examples"], None)  # generate once, outside the timing
        for n in (1, 2):
            rows.append(measure(n, config, workdir))
            r = rows[-1]
            print(f"{n} replica(s), 1 worker: before (tf.data state) {r['tfdata_state_bytes'] / 1e6:,.1f} MB "
                  f"(with ImageNet-sized JPEGs: {r['tfdata_state_bytes_imagenet_jpegs'] / 1e6:,.1f} MB; "
                  f"{r['tfdata_state_decoded_batches_held']} decoded global batches held); "
                  f"now (position) {r['position_bytes']:,} bytes: {r['ratio_tfdata_over_position']:,}x smaller",
                  flush=True)
    out = {"benchmark": "data_checkpoint_size", "cpu": cpu_name(), "config": config,
           "imagenet_mean_jpeg_bytes": round(IMAGENET_MEAN_JPEG), "rows": rows}
    name = args.out or (RESULTS.replace(".json", "_quick.json") if args.quick or args.smoke else RESULTS)
    write_result(name, out)


if __name__ == "__main__":
    main()
