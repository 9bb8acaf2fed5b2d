"""Images/s per CPU core of the shipped ImageNet input pipelines, beside the standard recipe (issue 62).

    python benchmarks/imagenet_input.py            # 512 JPEGs, 30 interleaved repeats (about 7 min on 2 cores)
    python benchmarks/imagenet_input.py --quick    # 32 JPEGs, batches of 8, 1 repeat: that it runs (seconds)

Data. Nothing is downloaded. `--images` JPEGs (default 512) are generated at ImageNet's size
distribution: three in four have a long side of 500 px (Flickr's size, ImageNet's mode), the
rest a long side drawn around 450 px (160-1400); aspect 4:3, 3:2, 1:1 or 16:9; landscape
about four times in five. Their content is natural-image-like for the JPEG decoder: smooth
random fields (luminance at three scales, colour at one) plus per-pixel noise, whose
strength is calibrated so that a 500x375 image is about 110 KB at quality 90, as issue 62's
reference (500x375, quality 90, 109 KB on average) and ImageNet's mean (147.9 GB over
1,281,167 train images, ~115 KB with tar headers) are. Encoded by `tf.io.encode_jpeg`
(libjpeg-turbo, 4:2:0). They are written as the two manual-download tars TFDS's
`imagenet2012` builder reads (ILSVRC2012_img_train.tar of one tar per WordNet class,
ILSVRC2012_img_val.tar of ILSVRC2012_val_*.JPEG; the same JPEGs in both), and the TFDS
dataset is prepared from them in a scratch directory exactly as `imagenet.prepare` does,
but into 16 files per split (`num_shards`; ImageNet's train split has 1,024, which the
pipeline's 16 streams share), so the pipelines read what a real run reads: TFRecords of
the original JPEG bytes. The images are cycled.

What is timed (runners; images of 224x224, float32, batches of `--batch` 32):
  train_N         the shipped train pipeline, `imagenet_input('train', batch_size=32, seed=0,
                  data_dir=...)` as built: the seekable shuffled record stream
                  (expframe/data/records.py, `_disk_train`), TFDS parsing, per-example stateless
                  seeds (order.example_seed), `preprocess_for_train` (stateless random-resized
                  crop decoded by `decode_and_crop_jpeg`, antialiased bilinear resize, stateless
                  flip, normalisation), batch, prefetch; N = 1 and 2 threads.
  eval_N          the shipped eval pipeline, `imagenet_input('validation', ...)` (TFDS
                  `as_dataset`, `preprocess_for_eval`: centre crop of 224 / 0.875, decoded by
                  `decode_and_crop_jpeg`, antialiased resize, normalisation), repeated.
  standard_1      issue 62's standard recipe on the same JPEGs held in memory:
                  `tf.image.sample_distorted_bounding_box` (stateful; the shipped crop's area,
                  aspect and attempts), `decode_and_crop_jpeg` of its window, `tf.image.resize`
                  to 224 (bilinear, no antialiasing), `random_flip_left_right`, cast to float32.
  train_memory_1  `preprocess_for_train` itself on the JPEGs in memory (seeds by position): the
                  train pipeline less its reading.
  and why the shipped pipeline is slower than the standard recipe, one step at a time against
  train_memory_1 (each variant is `preprocess_for_train` with that one step changed; with
  none changed it is `preprocess_for_train` exactly, tests/test_imagenet_input_bench.py):
  no_antialias_1, no_normalise_1, stateful_random_1 (sample_distorted_bounding_box and
  random_flip_left_right instead of the per-example stateless seeds), and
  decode_then_crop_1 (decode the whole JPEG, then crop: what `decode_and_crop_jpeg` saves).
Every in-memory runner has the shipped pipeline's shape: map (AUTOTUNE), batch, prefetch.

Threads. The pipelines set no thread options: every map and prefetch is `tf.data.AUTOTUNE`
(the train record stream interleaves its 16 streams with 16 parallel calls; TFDS's eval
reader interleaves files as its ReadConfig says), so a run uses the cores TensorFlow sees.
Here each dataset gets `tf.data.Options` with
`threading.private_threadpool_size = N` (the pool that runs every map function: AUTOTUNE's
parallelism is capped at its size), `threading.max_intra_op_parallelism = 1` (no op uses
more than its own thread) and `autotune.cpu_budget = N`. tf.data's own helper threads
(prefetch, the interleave's readers) are outside the pool; the process's CPU seconds over
the timed wall seconds (`cores busy`) show what a runner really used. Per core = images/s
/ N.

Repeats. Each runner's dataset is built once and run once untimed; then `--repeats`
(default 30, expframe/reproduce/spread.py's REPEATS) rounds, each running every runner
once in rotating order: a fresh iterator, `--warmup` batches (2), then `--per_repeat`
images (512) timed. A runner's figure is the median over repeats with a 95 % bootstrap
interval of the median (`spread.of`); a comparison is the paired ratio of two runners'
images/s, repeat by repeat, with its interval.

Cost: generating and preparing 512 JPEGs took 6 s (2 busy cores); a repeat runs ten runners
(eight on 1 thread, two on 2) for 512 images each plus warm-up, about 13 s at the rates the
smoke runs saw (350-420 images/s per core for the shipped train pipeline, 300-330 for eval,
700-770 for the standard recipe), so about 7 minutes for 30 repeats on 2 idle cores
(an estimate: the full run has not been timed yet). `--quick` (32 JPEGs, batches of 8,
1 repeat of 32 images) took 14 s end to end, TensorFlow's start included.

Results: a table on stdout naming the CPU, and JSON in `benchmarks/results/imagenet_input.json`
(or `--out`) whose top-level `images_per_sec_per_core`, `cpu` and `source` are what
expframe/plan/input_rate.json takes (the shipped train pipeline on one thread), with every
runner's samples and spreads, the comparisons and the why.
"""

import argparse
import dataclasses
import gc
import io
import os
import shutil
import sys
import tarfile
import tempfile
import time
from typing import Callable, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TFDS_DISABLE_GCS", "1")  # nothing from the network (imagenet.py asks TFDS for none either)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402
from absl import logging as absl_logging  # noqa: E402

from expframe import provenance  # noqa: E402  (expframe picks the CPU allocator before any TensorFlow op)
from expframe.data import imagenet, order  # noqa: E402
from expframe.reproduce import spread  # noqa: E402
from machine import cpu_name, load_average, machine, write_result  # noqa: E402  (benchmarks/machine.py)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "imagenet_input.json")
QUALITY = 90
TARGET_BYTES = 110_000            # a 500x375 JPEG at quality 90 (issue 62's reference: 109 KB on average)
REFERENCE_SHAPE = (375, 500)
SHARDS = 16                       # files per split (ImageNet's train split: 1,024, dealt into 16 streams)
SEED = 0                          # the train pipeline's seed (its order and augmentation)
LUMINANCE_OCTAVES = ((160, 45.0), (40, 22.0), (10, 10.0))  # (cell side in px, amplitude)
COLOUR_OCTAVE = (160, 20.0)


# -- the data ---------------------------------------------------------------------------------------


def _instruction_sets() -> str:
    """What TensorFlow's kernels depend on: AVX-512 and native bfloat16 or not (the name does not say)."""
    m = machine()
    return ("AVX-512" if m["avx512"] else "no AVX-512") + (", native bfloat16" if m["bf16"] else "")

def image_sizes(n: int, rng: np.random.Generator) -> list:
    """(height, width) of n images at ImageNet's size distribution (module docstring)."""
    sizes = []
    for _ in range(n):
        long = 500 if rng.random() < 0.75 else int(np.clip(rng.lognormal(np.log(450), 0.45), 160, 1400))
        aspect = rng.choice([4 / 3, 3 / 2, 1.0, 16 / 9], p=[0.6, 0.25, 0.08, 0.07])
        short = max(64, round(long / aspect))
        sizes.append((short, long) if rng.random() < 0.8 else (long, short))
    return sizes


def _field(height: int, width: int, cell: int, amplitude: float, channels: int,
           rng: np.random.Generator) -> np.ndarray:
    """A smooth random field: normal values on a grid of `cell` px, bilinearly upsampled."""
    grid = rng.normal(0.0, amplitude, (height // cell + 2, width // cell + 2, channels)).astype(np.float32)
    return tf.image.resize(grid, (height, width), method="bilinear").numpy()


def natural_image(height: int, width: int, rng: np.random.Generator, noise: float) -> np.ndarray:
    """uint8 [height, width, 3]: smooth luminance and colour fields plus per-pixel noise."""
    luminance = sum(_field(height, width, cell, amp, 1, rng) for cell, amp in LUMINANCE_OCTAVES)
    colour = _field(height, width, COLOUR_OCTAVE[0], COLOUR_OCTAVE[1], 3, rng)
    grain = rng.normal(0.0, noise, (height, width, 1)).astype(np.float32)
    base = rng.uniform(90.0, 160.0, (1, 1, 3)).astype(np.float32)
    return np.clip(base + luminance + colour + grain, 0, 255).astype(np.uint8)


def encode(image: np.ndarray) -> bytes:
    return tf.io.encode_jpeg(image, quality=QUALITY).numpy()


def calibrate_noise(target: int = TARGET_BYTES, shape: tuple = REFERENCE_SHAPE, steps: int = 12) -> float:
    """The noise whose 500x375 images (two, fixed seeds) average `target` bytes: bisection."""
    def size(noise):
        return np.mean([len(encode(natural_image(*shape, np.random.default_rng(s), noise))) for s in (1, 2)])

    low, high = 0.0, 64.0
    if size(low) >= target:
        return low
    for _ in range(steps):
        mid = (low + high) / 2
        low, high = (mid, high) if size(mid) < target else (low, mid)
    return (low + high) / 2


def make_jpegs(n: int, seed: int = 0) -> tuple:
    """(n JPEGs as bytes, their description)."""
    noise = calibrate_noise()
    rng = np.random.default_rng(seed)
    sizes = image_sizes(n, rng)
    jpegs = [encode(natural_image(h, w, rng, noise)) for h, w in sizes]
    heights, widths = np.array([s[0] for s in sizes]), np.array([s[1] for s in sizes])
    lengths = np.array([len(j) for j in jpegs])
    return jpegs, {"images": n, "quality": QUALITY, "noise": round(noise, 3),
                   "mean_height": float(heights.mean()), "mean_width": float(widths.mean()),
                   "mean_pixels": float((heights * widths).mean()),
                   "long_side_500_share": float(np.mean(np.maximum(heights, widths) == 500)),
                   "min_pixels": int((heights * widths).min()), "max_pixels": int((heights * widths).max()),
                   "mean_bytes": float(lengths.mean()), "min_bytes": int(lengths.min()),
                   "max_bytes": int(lengths.max()),
                   "bytes_per_pixel": float(lengths.sum() / (heights * widths).sum())}


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_manual_dir(manual: str, jpegs: Sequence[bytes], class_names: Sequence[str]) -> None:
    """ILSVRC2012_img_train.tar (one tar per class, <wnid>_<i>.JPEG) and ILSVRC2012_img_val.tar
    (ILSVRC2012_val_<8 digits>.JPEG) in `manual`, as image-net.org ships them."""
    os.makedirs(manual, exist_ok=True)
    classes = class_names[:max(1, min(32, len(jpegs) // 8))]
    with tarfile.open(os.path.join(manual, imagenet.MANUAL_FILES[0]), "w") as train:
        for c, wnid in enumerate(classes):
            inner = io.BytesIO()
            with tarfile.open(fileobj=inner, mode="w") as per_class:
                for i in range(c, len(jpegs), len(classes)):
                    _add(per_class, f"{wnid}_{i}.JPEG", jpegs[i])
            _add(train, f"{wnid}.tar", inner.getvalue())
    with tarfile.open(os.path.join(manual, imagenet.MANUAL_FILES[1]), "w") as val:
        for i, jpeg in enumerate(jpegs):
            _add(val, f"ILSVRC2012_val_{i + 1:08d}.JPEG", jpeg)


def prepare(data_dir: str, manual: str, shards: int) -> tfds.core.DatasetBuilder:
    """TFDS imagenet2012 prepared from `manual` into `data_dir` as `imagenet.prepare` does
    (no GCS), in `shards` files per split; then `imagenet.prepare` finds it prepared."""
    builder = imagenet._builder(data_dir)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=manual, try_download_gcs=False, num_shards=shards))
    return imagenet.prepare(data_dir)


def shards_for(n: int) -> int:
    return max(1, min(SHARDS, n // 16))


# -- what is timed ----------------------------------------------------------------------------------

def thread_options(threads: int) -> tf.data.Options:
    """tf.data on `threads` threads: its private pool, one thread per op, the autotuner's budget."""
    options = tf.data.Options()
    options.threading.private_threadpool_size = threads
    options.threading.max_intra_op_parallelism = 1
    options.autotune.cpu_budget = threads
    return options


def recipe(jpeg: tf.Tensor, seed: tf.Tensor, image_size: int = 224, antialias: bool = True,
           normalise: bool = True, stateless: bool = True, fused: bool = True) -> tf.Tensor:
    """`imagenet.preprocess_for_train` of JPEG bytes with one step changeable: all True is it
    exactly; antialias=False resizes without antialiasing, normalise=False casts without
    normalising, stateless=False draws the crop and flip from TensorFlow's stateful random ops
    (the seed unused), fused=False decodes the whole JPEG and then crops."""
    shape = tf.image.extract_jpeg_shape(jpeg)
    if stateless:
        seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), num=2)
        window = imagenet.random_crop_window(shape, seeds[0])
    else:
        begin, size, _ = tf.image.sample_distorted_bounding_box(
            shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), min_object_covered=0.0,
            aspect_ratio_range=imagenet.ASPECT_RATIO_RANGE, area_range=imagenet.AREA_RANGE,
            max_attempts=imagenet.MAX_CROP_ATTEMPTS, use_image_if_no_bounding_boxes=True)
        window = tf.stack([begin[0], begin[1], size[0], size[1]])
    if fused:
        crop = tf.image.decode_and_crop_jpeg(jpeg, window, channels=3)
    else:
        crop = imagenet._crop(tf.io.decode_jpeg(jpeg, channels=3), window)
    crop = tf.image.resize(crop, [image_size, image_size], method="bilinear", antialias=antialias)
    crop = (tf.image.stateless_random_flip_left_right(crop, seeds[1]) if stateless
            else tf.image.random_flip_left_right(crop))
    image = imagenet._normalise(crop, tf.float32) if normalise else tf.cast(crop, tf.float32)
    return tf.ensure_shape(image, [image_size, image_size, 3])


def standard(jpeg: tf.Tensor, seed: tf.Tensor, image_size: int = 224) -> tf.Tensor:
    """Issue 62's standard recipe: stateful crop window, decode_and_crop_jpeg, plain bilinear
    resize, random flip, cast (the seed unused)."""
    return recipe(jpeg, seed, image_size, antialias=False, normalise=False, stateless=False)


@dataclasses.dataclass(frozen=True)
class Runner:
    """One timed dataset: `build(config)` makes it (before the thread options)."""
    name: str
    what: str
    threads: int
    build: Callable[[dict], tf.data.Dataset]


def shipped_train(config: dict) -> tf.data.Dataset:
    return imagenet.imagenet_input("train", None, batch_size=config["batch"], seed=SEED,
                                   data_dir=config["data_dir"], image_size=config["image_size"])


def shipped_eval(config: dict) -> tf.data.Dataset:
    return imagenet.imagenet_input("validation", None, batch_size=config["batch"], data_dir=config["data_dir"],
                                   image_size=config["image_size"]).repeat()


def in_memory(preprocess: Callable) -> Callable[[dict], tf.data.Dataset]:
    """The JPEGs held in memory, cycled, each with its global position's seed, through
    `preprocess(jpeg, seed, image_size)`, in the shipped pipeline's shape."""
    def build(config: dict) -> tf.data.Dataset:
        jpegs = tf.data.Dataset.from_tensor_slices(config["jpegs"]).repeat()
        ds = tf.data.Dataset.zip(tf.data.Dataset.counter(dtype=tf.int64), jpegs).map(
            lambda position, jpeg: {"image": preprocess(jpeg, order.example_seed(SEED, position), config["image_size"]),
                                    "label": tf.zeros([], tf.int32)},
            num_parallel_calls=tf.data.AUTOTUNE)
        return ds.batch(config["batch"], drop_remainder=True).prefetch(tf.data.AUTOTUNE)
    return build


def _variant(**change) -> Callable:
    return lambda jpeg, seed, size: recipe(jpeg, seed, size, **change)


RUNNERS = (
    Runner("train_1", "shipped train pipeline (imagenet_input, from its records)", 1, shipped_train),
    Runner("train_2", "shipped train pipeline (imagenet_input, from its records)", 2, shipped_train),
    Runner("eval_1", "shipped eval pipeline (imagenet_input, from its records)", 1, shipped_eval),
    Runner("eval_2", "shipped eval pipeline (imagenet_input, from its records)", 2, shipped_eval),
    Runner("standard_1", "standard recipe (in memory)", 1, in_memory(standard)),
    Runner("train_memory_1", "shipped preprocess_for_train (in memory)", 1,
           in_memory(lambda jpeg, seed, size: imagenet.preprocess_for_train(jpeg, seed, size))),
    Runner("no_antialias_1", "preprocess_for_train without antialiasing (in memory)", 1,
           in_memory(_variant(antialias=False))),
    Runner("no_normalise_1", "preprocess_for_train without normalisation (in memory)", 1,
           in_memory(_variant(normalise=False))),
    Runner("stateful_random_1", "preprocess_for_train with stateful random ops, no per-example seeds (in memory)", 1,
           in_memory(_variant(stateless=False))),
    Runner("decode_then_crop_1", "preprocess_for_train decoding the whole JPEG, then cropping (in memory)", 1,
           in_memory(_variant(fused=False))),
)
NAMES = tuple(r.name for r in RUNNERS)

# (name, numerator, denominator, what): paired ratios of images/s, repeat by repeat.
COMPARISONS = (
    ("train_over_standard", "train_1", "standard_1", "shipped train pipeline / standard recipe, images/s, 1 thread"),
    ("train_2_over_1", "train_2", "train_1", "shipped train pipeline, 2 threads / 1 thread, images/s"),
    ("eval_2_over_1", "eval_2", "eval_1", "shipped eval pipeline, 2 threads / 1 thread, images/s"),
)
# (name, faster, slower, what): why the shipped train pipeline is slower than the standard
# recipe; faster / slower > 1 is what the step costs (1 - slower / faster of its time).
WHY = (
    ("reading", "train_memory_1", "train_1",
     "reading the records (stream, parse): preprocess_for_train in memory / the train pipeline"),
    ("antialias", "no_antialias_1", "train_memory_1",
     "antialiased resize: without antialiasing / preprocess_for_train, in memory"),
    ("normalise", "no_normalise_1", "train_memory_1",
     "normalisation: without it / preprocess_for_train, in memory"),
    ("stateless_seeds", "stateful_random_1", "train_memory_1",
     "per-example stateless seeds: stateful random ops / preprocess_for_train, in memory"),
    ("all_preprocessing", "standard_1", "train_memory_1",
     "all of preprocess_for_train's differences: standard recipe / preprocess_for_train, in memory"),
    ("decode_and_crop", "train_memory_1", "decode_then_crop_1",
     "decoding only the crop (shipped) / decoding the whole JPEG then cropping, in memory"),
)


# -- timing -----------------------------------------------------------------------------------------

def time_once(ds: tf.data.Dataset, warmup: int, images: int) -> tuple:
    """(wall seconds, images, process CPU seconds) of `images` or a few more images from a
    fresh iterator of `ds`, after `warmup` batches."""
    iterator = iter(ds)
    for _ in range(warmup):
        next(iterator)
    counted = 0
    cpu, start = time.process_time(), time.perf_counter()
    while counted < images:
        counted += int(next(iterator)["label"].shape[0])
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    del iterator
    return seconds, counted, cpu


def measure(runners: Sequence[Runner], config: dict, repeats: int, warmup: int, per_repeat: int,
            say: Callable[[str], None] = print) -> dict:
    """name -> {"seconds", "images", "cpu_s"}: one sample per repeat, runners interleaved."""
    datasets = {r.name: r.build(config).with_options(thread_options(r.threads)) for r in runners}
    for r in runners:  # first iterators, file caches, kernels: not timed
        time_once(datasets[r.name], warmup, config["batch"])
        gc.collect()
    samples = {r.name: {"seconds": [], "images": [], "cpu_s": []} for r in runners}
    names = [r.name for r in runners]
    for i in range(repeats):
        started = time.perf_counter()
        for name in names[i % len(names):] + names[:i % len(names)]:  # rotate who goes first
            seconds, images, cpu = time_once(datasets[name], warmup, per_repeat)
            for key, value in zip(("seconds", "images", "cpu_s"), (seconds, images, cpu), strict=True):
                samples[name][key].append(value)
            gc.collect()  # the iterator's threads go now, not during the next runner
        if i == 0 and repeats > 1:
            took = time.perf_counter() - started
            say(f"repeat 1 of {repeats} took {took:.1f} s: about {took * repeats / 60:.1f} min for all")
    return samples


def _rates(sample: dict) -> list:
    return [n / s for n, s in zip(sample["images"], sample["seconds"], strict=True)]


def summarise(runners: Sequence[Runner], samples: dict) -> dict:
    """Per runner: images/s, per core (with its spread), cores busy, images per CPU second."""
    out = {}
    for r in runners:
        sample = samples[r.name]
        rates = _rates(sample)
        out[r.name] = {
            "what": r.what, "threads": r.threads,
            "images_per_sec": float(np.median(rates)),
            "per_core": spread.of([x / r.threads for x in rates]),
            "cores_busy": float(np.median([c / s for c, s in zip(sample["cpu_s"], sample["seconds"], strict=True)])),
            "images_per_cpu_second": float(np.median([n / c for n, c in zip(sample["images"], sample["cpu_s"],
                                                                              strict=True) if c > 0] or [0.0])),
            "ms_per_image": float(1e3 / np.median(rates)),
            **sample}
    return out


def paired(samples: dict, faster: str, slower: str) -> dict:
    """The spread of images/s of `faster` over `slower`, repeat by repeat."""
    return spread.of([a / b for a, b in zip(_rates(samples[faster]), _rates(samples[slower]), strict=True)])


def comparisons(samples: dict) -> list:
    return [{"name": name, "numerator": a, "denominator": b, "what": what, "spread": paired(samples, a, b)}
            for name, a, b, what in COMPARISONS if a in samples and b in samples]


def why(samples: dict, summary: dict) -> list:
    """Each step's cost: the paired ratio without it / with it, and the milliseconds per image
    (1 thread) it adds."""
    out = []
    for name, faster, slower, what in WHY:
        if faster in samples and slower in samples:
            ratio = paired(samples, faster, slower)
            out.append({"name": name, "faster": faster, "slower": slower, "what": what, "spread": ratio,
                        "share_of_time": 1 - 1 / ratio["median"],
                        "ms_per_image": summary[slower]["ms_per_image"] - summary[faster]["ms_per_image"]})
    return out


# -- report -----------------------------------------------------------------------------------------

def _interval(found: dict, digits: int = 0) -> str:
    return f"{found['median']:.{digits}f} ({found['low']:.{digits}f}-{found['high']:.{digits}f})"


def print_table(summary: dict, compared: list, reasons: list) -> None:
    print(f"{'runner':<20} {'threads':>7} {'images/s':>9} {'per core (95% interval)':>24} {'cores busy':>10} "
          f"{'img/CPU-s':>9} {'ms/img':>7}  what")
    for name, r in summary.items():
        print(f"{name:<20} {r['threads']:>7} {r['images_per_sec']:>9.1f} {_interval(r['per_core']):>24} "
              f"{r['cores_busy']:>10.2f} {r['images_per_cpu_second']:>9.1f} {r['ms_per_image']:>7.2f}  {r['what']}")
    for c in compared:
        print(f"{c['what']} (paired): {_interval(c['spread'], 3)}")
    if reasons:
        print("Why the shipped train pipeline is slower than the standard recipe (1 thread; ratio > 1: the step "
              "costs; its share of the slower one's time; ms per image):")
        for w in reasons:
            print(f"  {w['what']}: {_interval(w['spread'], 3)}, {w['share_of_time']:+.0%}, "
                  f"{w['ms_per_image']:+.2f} ms")


def headline(summary: dict, data: dict, config: dict, repeats: int, quick: bool, load_start: float) -> dict:
    """The fields expframe/plan/input_rate.json takes: the train pipeline's rate on one thread."""
    found = summary["train_1"]["per_core"]
    sha, dirty = provenance.commit()
    return {
        "images_per_sec_per_core": found["median"],
        "cpu": f"one core of a {machine()['cores']}-core {cpu_name()} ({_instruction_sets()}; tf.data private "
               f"thread pool of 1, intra-op "
               f"parallelism 1), TensorFlow {tf.__version__}, 1-minute load average {load_start:.2f} at the start",
        "source": (f"benchmarks/imagenet_input.py{' --quick' if quick else ''} on {provenance.now()[:10]}, commit "
                   f"{sha[:12]}{' (dirty)' if dirty else ''}: the shipped train pipeline (expframe/data/imagenet.py "
                   f"imagenet_input('train'), batch {config['batch']}) reading TFDS imagenet2012 records generated "
                   f"in ImageNet's layout ({data['images']} JPEGs, mean {data['mean_width']:.0f}x"
                   f"{data['mean_height']:.0f} px, {data['mean_bytes'] / 1e3:.0f} KB, quality {QUALITY}), one "
                   f"tf.data thread: median of {repeats} repeats of {config['per_repeat']} images, 95 % interval "
                   f"{found['low']:.0f}-{found['high']:.0f} images/s"),
    }


def write_and_report(out: str, result: dict) -> None:
    """Writes `result` (with its load_average and wall_s) to `out` and says so in one line."""
    write_result(out, result, say=False)
    print(f"1-minute load average {result['load_average']['start'][0]:.2f} at start, "
          f"{result['load_average']['end'][0]:.2f} at end; wrote {out} ({result['wall_s']:.0f} s)")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="32 JPEGs, batch 8, 1 repeat of 32 images: that it runs")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"interleaved repeats (default {spread.REPEATS}; 1 for --quick)")
    parser.add_argument("--images", type=int, default=None, help="JPEGs generated (default 512; 32 for --quick)")
    parser.add_argument("--per_repeat", type=int, default=None, help="images timed per runner and repeat "
                                                                     "(default 512; 32 for --quick)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default 32; 8 for --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per repeat (default 2)")
    parser.add_argument("--runners", nargs="+", choices=NAMES, default=list(NAMES),
                        help="which to time (default all; train_1 always)")
    parser.add_argument("--keep", default=None, help="generate the data in this directory and keep it")
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    quick = args.quick
    n = args.images or (32 if quick else 512)
    repeats = args.repeats or (1 if quick else spread.REPEATS)
    config = {"batch": args.batch or (8 if quick else 32), "image_size": 224,
              "per_repeat": args.per_repeat or (32 if quick else 512), "warmup": args.warmup}
    runners = [r for r in RUNNERS if r.name in args.runners or r.name == "train_1"]
    absl_logging.set_verbosity(absl_logging.WARNING)
    tfds.disable_progress_bar()

    started, load_start = time.perf_counter(), load_average() or [0.0]
    scratch = args.keep or tempfile.mkdtemp(prefix="imagenet_input_")
    try:
        print(f"{cpu_name()}, {os.cpu_count()} CPUs; TensorFlow {tf.__version__}", flush=True)
        jpegs, data = make_jpegs(n)
        data_dir, manual = os.path.join(scratch, "tfds"), os.path.join(scratch, "manual")
        write_manual_dir(manual, jpegs, imagenet._builder(data_dir).info.features["label"].names)
        builder = prepare(data_dir, manual, shards_for(n))
        data.update(shards={s: len(builder.info.splits[s].file_instructions) for s in ("train", "validation")},
                    generate_and_prepare_s=round(time.perf_counter() - started, 1))
        print(f"data: {n} JPEGs (TFDS imagenet2012 prepared from ILSVRC2012 tars: {data['shards']['train']} train "
              f"and {data['shards']['validation']} validation files, the same JPEGs in both), mean "
              f"{data['mean_width']:.0f}x{data['mean_height']:.0f} px ({data['mean_pixels'] / 1e3:.0f}k pixels, "
              f"{data['long_side_500_share']:.0%} with a long side of 500), {data['mean_bytes'] / 1e3:.1f} KB "
              f"({data['min_bytes'] / 1e3:.0f}-{data['max_bytes'] / 1e3:.0f}), quality {QUALITY}; "
              f"{data['generate_and_prepare_s']} s to make", flush=True)
        print(f"batch {config['batch']}, {config['image_size']} px float32; {repeats} interleaved repeat(s) of "
              f"{config['per_repeat']} images after {config['warmup']} batches; tf.data private thread pool of N "
              f"threads, intra-op parallelism 1, autotune CPU budget N", flush=True)
        samples = measure(runners, dict(config, data_dir=data_dir, jpegs=tf.constant(jpegs)), repeats, config["warmup"],
                          config["per_repeat"])
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    summary = summarise(runners, samples)
    compared, reasons = comparisons(samples), why(samples, summary)
    print_table(summary, compared, reasons)
    result = {"benchmark": "imagenet_input", **headline(summary, data, config, repeats, quick, load_start[0]),
              "images_per_sec_per_core_spread": summary["train_1"]["per_core"],
              "quick": quick, "repeats": repeats, "config": config, "data": data,
              "threading": "tf.data.Options: threading.private_threadpool_size = threads, "
                           "threading.max_intra_op_parallelism = 1, autotune.cpu_budget = threads",
              "machine": machine(), "tensorflow": tf.__version__,
              "load_average": {"start": load_start, "end": load_average() or [0.0]},
              "runners": summary, "comparisons": compared, "why": reasons,
              "spread": {**{f"{name}_per_core": r["per_core"] for name, r in summary.items()},
                         **{c["name"]: c["spread"] for c in compared + reasons}},
              "wall_s": round(time.perf_counter() - started, 1)}
    write_and_report(args.out, result)


if __name__ == "__main__":
    main()
