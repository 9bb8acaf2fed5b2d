"""`shapes`: an offline TFDS dataset of labelled images of geometric shapes.

The images are drawn locally with numpy, so the dataset builds without a network
in seconds. It is what the tests, the quickstart and the shapes GAN metrics train
on: a small CNN learns it to high accuracy in minutes on a CPU, yet it is not
trivial (colours, size, position, rotation, background shading and noise all vary
per image).

Configs (`tfds.load("shapes/32x32")`, `tfds.load("shapes/64x64")`):

| config  | image    | train  | test  |
|---------|----------|--------|-------|
| `32x32` | 32x32x3  | 20,000 | 2,000 |
| `64x64` | 64x64x3  | 10,000 | 1,000 |

Features: `image` (uint8 HxWx3), `label` (`ClassLabel`, names `CLASS_NAMES`, 10
classes), `id` (int64, the example's index within its split: 0..N-1, unique per
split). Examples are stored in id order (the classes are already in random order);
shuffle in the input pipeline.

Determinism: example `id` of a split depends only on (version, image size, split,
id). Examples are drawn in chunks of `_CHUNK` by a numpy RNG seeded with
(`_SEED`, size, split, chunk), so a version always gives the same bytes, and a
build with fewer examples (`shapes_config(32, num_train=500)`) is an exact prefix
of the full one.

Usage:

    from expframe.data import shapes
    ds = shapes.load_shapes("train", size=32)    # prepares on first use, offline
    for ex in ds.take(1):
        ex["image"], ex["label"], ex["id"]

    import tensorflow_datasets as tfds            # plain TFDS works too, once this
    ds = tfds.load("shapes/32x32", split="test")  # module has been imported

`data_dir`: where TFDS keeps prepared datasets; `None` means the TFDS default:
`$TFDS_DATA_DIR` if set, else `~/tensorflow_datasets`. The data lands in
`<data_dir>/shapes/<config>/<version>/`. Nothing touches the network: there is
nothing to download, and TFDS's GCS lookup is switched off for these builds.
A build says so, in place of TFDS's "Downloading and preparing dataset Unknown
size ..." and "... downloaded and prepared to ..." (here `<dir>` is
`<data_dir>/shapes/32x32/2.0.0`):

    shapes/32x32: generating 20,000 train and 2,000 test images locally (drawn with
        numpy; nothing is downloaded) into <dir> ...
    shapes/32x32: generated 22,000 images locally in <seconds> s: <size on disk> in
        <dir>; later runs reuse them.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
import warnings
from typing import Callable, Iterator

import numpy as np
import PIL.Image
import tensorflow as tf
import tensorflow_datasets as tfds

CLASS_NAMES = ("circle", "square", "triangle", "star", "cross", "ring",
               "ellipse", "rhombus", "arrow", "crescent")
NUM_CLASSES = len(CLASS_NAMES)
SPLITS = ("train", "test")

_SEED = 20_180_731  # changing it, or any drawing code, needs a new Shapes.VERSION
_CHUNK = 1000  # examples per seeded RNG chunk: the unit of determinism
_BATCH = 250  # examples drawn at once within a chunk (bounds memory, not output)
_SUPERSAMPLES = 96  # anti-aliasing: draw at least ~96 samples per side, then average


# Shape masks. Each takes local coordinates (u, v) of supersampled pixels, in units
# of the shape's radius after undoing the image's rotation, and says which lie
# inside. Every shape fits in the unit disc, so a shape of radius r pixels whose
# centre is at least r from each border lies wholly inside the image.

# TFDS (tensorflow-datasets 4.9) prints its "Downloading and preparing dataset ..." and
# "Dataset ... downloaded and prepared to ..." lines from these two DatasetBuilder
# methods, which `Shapes` overrides to say what it really does. A TFDS without them
# would print its own lines again: say so at import rather than silently.
_TFDS_MESSAGES = ("_log_download_bytes", "_log_download_done")
if not all(callable(getattr(tfds.core.DatasetBuilder, name, None)) for name in _TFDS_MESSAGES):
    warnings.warn(f"expframe.data.shapes: tensorflow-datasets {tfds.__version__} has no DatasetBuilder."
                  f"{' or '.join(_TFDS_MESSAGES)} (tensorflow-datasets 4.9 has): building shapes may print TFDS's "
                  "'Downloading and preparing dataset' line, though nothing is downloaded.", stacklevel=1)


class _CustomConfigNotice(logging.Filter):
    """Drops TFDS's "Using custom data configuration: ShapesConfig(...)" warning, which it
    logs each time a builder is made with a config it does not list: every `shapes` load
    of a size or split count other than the two listed (the tests', the shrunk
    quickstarts'), once per run and once more per evaluation. The config is ours and
    meant: the line only buried the run's own output."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage().startswith("Using custom data configuration: ")
                    and "ShapesConfig(" in record.getMessage())


logging.getLogger("absl").addFilter(_CustomConfigNotice())


def _half_planes(u: np.ndarray, v: np.ndarray, n: int, dist: float) -> np.ndarray:
    """How many of the n half-planes u*cos(a) + v*sin(a) <= dist, a = 2*pi*k/n, hold."""
    count = np.zeros(u.shape, np.uint8)
    for a in 2 * np.pi * np.arange(n) / n:
        count += u * np.float32(np.cos(a)) + v * np.float32(np.sin(a)) <= np.float32(dist)
    return count


def _polygon(u: np.ndarray, v: np.ndarray, sides: int) -> np.ndarray:
    """Inside a regular polygon of circumradius 1: its edges lie cos(pi/n) from the centre."""
    return _half_planes(u, v, sides, np.cos(np.pi / sides)) == sides


def _star(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Inside a pentagram of circumradius 1.

    Its 5 lines join every second vertex, at cos(2*pi/5) from the centre. The inner
    pentagon is inside all 5 half-planes, a tip inside 4, and any point outside the
    star inside at most 3.
    """
    return _half_planes(u, v, 5, np.cos(2 * np.pi / 5)) >= 4


def _arrow(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    shaft = (np.abs(v) <= 0.22) & (u >= -0.9) & (u <= 0.15)
    head = (u >= 0.05) & (u <= 0.95) & (np.abs(v) <= 0.65 * (0.95 - u) / 0.9)
    return shaft | head


def _crescent(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return (u * u + v * v <= 1.0) & ((u - 0.55) ** 2 + v * v > 0.75**2)


_MASKS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "circle": lambda u, v: u * u + v * v <= 1.0,
    "square": lambda u, v: np.maximum(np.abs(u), np.abs(v)) <= 0.72,
    "triangle": lambda u, v: _polygon(u, v, 3),
    "star": _star,
    "cross": lambda u, v: (np.minimum(np.abs(u), np.abs(v)) <= 0.28) & (np.maximum(np.abs(u), np.abs(v)) <= 0.9),
    "ring": lambda u, v: (u * u + v * v <= 1.0) & (u * u + v * v >= 0.55**2),
    "ellipse": lambda u, v: u * u + (v / 0.5) ** 2 <= 1.0,
    "rhombus": lambda u, v: np.abs(u) + np.abs(v) / 0.55 <= 1.0,
    "arrow": _arrow,
    "crescent": _crescent,
}
assert tuple(_MASKS) == CLASS_NAMES


def _draw(rng: np.random.Generator, n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Draws n random images (uint8 [n, size, size, 3]) and their labels (int64 [n])."""
    labels = rng.integers(0, NUM_CLASSES, n)
    radius = rng.uniform(0.28, 0.46, n) * size  # pixels
    cx = rng.uniform(radius, size - radius)
    cy = rng.uniform(radius, size - radius)
    angle = rng.uniform(0.0, 2 * np.pi, n)
    background = rng.uniform(0.0, 1.0, (n, 3))
    foreground = rng.uniform(0.0, 1.0, (n, 3))
    # Keep the shape visible: redraw foreground colours too close to the background.
    while (close := np.linalg.norm(foreground - background, axis=1) < 0.45).any():
        foreground[close] = rng.uniform(0.0, 1.0, (close.sum(), 3))
    gradient = rng.uniform(-0.25, 0.25, (n, 2))  # brightness change across the image
    noise_std = rng.uniform(0.01, 0.07, n)
    noise = rng.standard_normal((n, size, size, 3), dtype=np.float32)

    # Coverage of each pixel by the shape, from k x k supersamples per pixel. Images
    # are processed grouped by class (contiguous slices, no copies), then put back.
    k = max(2, -(-_SUPERSAMPLES // size))
    order = np.argsort(labels, kind="stable")
    grid = (np.arange(size * k, dtype=np.float32) + 0.5) / k
    dx = grid[None, None, :] - cx[order].astype(np.float32)[:, None, None]
    dy = grid[None, :, None] - cy[order].astype(np.float32)[:, None, None]
    cos = (np.cos(angle) / radius)[order].astype(np.float32)[:, None, None]
    sin = (np.sin(angle) / radius)[order].astype(np.float32)[:, None, None]
    u, v = cos * dx + sin * dy, cos * dy - sin * dx  # rotate by -angle, scale by 1/radius
    inside = np.empty(u.shape, dtype=bool)
    bounds = np.searchsorted(labels[order], np.arange(NUM_CLASSES + 1))
    for label, mask in enumerate(_MASKS.values()):
        group = slice(bounds[label], bounds[label + 1])
        inside[group] = mask(u[group], v[group])
    hits = inside.view(np.uint8).reshape(n, size, k, size, k).sum(axis=4, dtype=np.uint16).sum(axis=2, dtype=np.uint16)
    coverage = np.empty((n, size, size, 1), np.float32)
    coverage[order] = hits[..., None] / np.float32(k * k)

    ramp = (np.arange(size, dtype=np.float32) + 0.5) / size - 0.5
    shade = gradient[:, 0, None, None] * ramp[None, None, :] + gradient[:, 1, None, None] * ramp[None, :, None]
    back = background[:, None, None, :] + shade[..., None]
    image = back * (1 - coverage) + foreground[:, None, None, :] * coverage
    image += noise_std[:, None, None, None] * noise
    return np.round(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8), labels.astype(np.int64)


def _iterate(split: str, stop: int, size: int, start: int = 0) -> Iterator[tuple[int, np.ndarray, int]]:
    """Yields (id, image, label) for ids start..stop-1 of a split."""
    if split not in SPLITS:
        raise ValueError(f"shapes: unknown split {split!r}; use one of {SPLITS}.")
    for chunk in range(start // _CHUNK, -(-stop // _CHUNK)):
        rng = np.random.default_rng([_SEED, size, SPLITS.index(split), chunk])
        parts = [_draw(rng, _BATCH, size) for _ in range(_CHUNK // _BATCH)]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
        for i in range(max(start, chunk * _CHUNK), min(stop, (chunk + 1) * _CHUNK)):
            yield i, images[i - chunk * _CHUNK], int(labels[i - chunk * _CHUNK])


def generate(split: str, num_examples: int, size: int = 32,
             start: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draws examples `start .. start + num_examples - 1` of a split as numpy arrays.

    These are byte for byte the examples the TFDS builder stores; useful where a
    prepared dataset is not wanted (quick experiments, metrics tests).

    Args:
      split: "train" or "test".
      num_examples: how many examples.
      size: image height and width in pixels.
      start: id of the first example.

    Returns:
      (images uint8 [N, size, size, 3], labels int64 [N], ids int64 [N]).
    """
    images = np.zeros((num_examples, size, size, 3), np.uint8)
    labels = np.zeros((num_examples,), np.int64)
    for i, image, label in _iterate(split, start + num_examples, size, start):
        images[i - start], labels[i - start] = image, label
    return images, labels, np.arange(start, start + num_examples, dtype=np.int64)


@dataclasses.dataclass(eq=False, kw_only=True)
class ShapesConfig(tfds.core.BuilderConfig):
    """A `shapes` configuration: image size and examples per split.

    Attributes:
      image_size: height and width of the images, in pixels.
      num_train: examples in the train split.
      num_test: examples in the test split.
    """

    image_size: int = 32
    num_train: int = 20_000
    num_test: int = 2_000


class Shapes(tfds.core.GeneratorBasedBuilder):
    """Labelled images of geometric shapes, generated locally (no download).

    Configs `32x32` (default) and `64x64`; see the module docstring. Usage:

        builder = Shapes(config="32x32", data_dir=data_dir)
        builder.download_and_prepare()
        ds = builder.as_dataset(split="train")
    """

    VERSION = tfds.core.Version("2.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: 12 classes.",
                     "2.0.0": "10 classes: pentagon and hexagon dropped (at 32x32 they are nearly "
                              "circles, which kept the quickstart from 0.90 top-1 within minutes)."}
    BUILDER_CONFIGS = [
        ShapesConfig(name="32x32", image_size=32, num_train=20_000, num_test=2_000,
                     description="32x32 images"),
        ShapesConfig(name="64x64", image_size=64, num_train=10_000, num_test=1_000,
                     description="64x64 images"),
    ]

    def _info(self) -> tfds.core.DatasetInfo:
        size = self.builder_config.image_size
        return tfds.core.DatasetInfo(
            builder=self,
            description=("Geometric shapes (" + ", ".join(CLASS_NAMES) + ") of random colour, size, "
                         "position and rotation on a shaded, noisy background, drawn locally with numpy."),
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(shape=(size, size, 3), dtype=np.uint8),
                "label": tfds.features.ClassLabel(names=CLASS_NAMES),
                "id": tfds.features.Scalar(dtype=np.int64, doc="index of the example in its split"),
            }),
            supervised_keys=("image", "label"),
            disable_shuffling=True,  # stored in id order, in which the classes are already random
        )

    def _log_download_bytes(self) -> None:
        """Replaces TFDS's "Downloading and preparing dataset Unknown size ..." line: what
        is generated, and where (nothing is downloaded)."""
        config = self.builder_config
        self._generation_started = time.monotonic()
        print(f"{self.name}/{config.name}: generating {config.num_train:,} train and {config.num_test:,} test "
              f"images locally (drawn with numpy; nothing is downloaded) into {self.data_dir} ...", flush=True)

    def _log_download_done(self) -> None:
        """Replaces TFDS's "Dataset ... downloaded and prepared to ..." line: what was
        generated, how long it took, its size on disk and where."""
        config = self.builder_config
        took = time.monotonic() - getattr(self, "_generation_started", time.monotonic())
        on_disk = sum(entry.stat().st_size for entry in os.scandir(self.data_dir) if entry.is_file())
        print(f"{self.name}/{config.name}: generated {config.num_train + config.num_test:,} images locally in "
              f"{took:.1f} s: {tfds.core.units.Size(on_disk)} in {self.data_dir}; later runs reuse them.", flush=True)

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        del dl_manager  # nothing to download
        config = self.builder_config
        return {"train": self._generate_examples("train", config.num_train),
                "test": self._generate_examples("test", config.num_test)}

    def _generate_examples(self, split: str, num_examples: int):
        for i, image, label in _iterate(split, num_examples, self.builder_config.image_size):
            # PNG-encoded here with PIL: about twice as fast as TFDS's per-example TF op.
            png = io.BytesIO()
            PIL.Image.fromarray(image).save(png, format="png")
            yield i, {"image": png.getvalue(), "label": label, "id": i}


def shapes_config(size: int = 32, num_train: int | None = None, num_test: int | None = None) -> ShapesConfig:
    """The registered config for `size`, or a custom one with other example counts.

    A custom config is named `<size>x<size>_train<N>_test<M>`, so it is prepared in
    its own directory and never mistaken for the full dataset.

    Args:
      size: 32 or 64.
      num_train: train examples; None keeps the config's default.
      num_test: test examples; None keeps the config's default.

    Returns:
      A `ShapesConfig` to pass as `Shapes(config=...)`.
    """
    base = Shapes.builder_configs.get(f"{size}x{size}")
    if base is None:
        sizes = sorted(c.image_size for c in Shapes.BUILDER_CONFIGS)
        raise ValueError(f"shapes: no config for size={size}; use one of {sizes}.")
    num_train = base.num_train if num_train is None else num_train
    num_test = base.num_test if num_test is None else num_test
    if (num_train, num_test) == (base.num_train, base.num_test):
        return base
    return ShapesConfig(name=f"{base.name}_train{num_train}_test{num_test}", image_size=size,
                        num_train=num_train, num_test=num_test,
                        description=f"{base.description}, {num_train} train / {num_test} test examples")


def load_shapes(split: str, size: int = 32, data_dir: str | None = None, *,
                num_train: int | None = None, num_test: int | None = None,
                shuffle_files: bool = False) -> tf.data.Dataset:
    """Prepares `shapes` if it is not yet in `data_dir` (offline, seconds) and returns a split.

    Args:
      split: a TFDS split spec: "train", "test", "train[:10%]", ...
      size: image size, 32 or 64 (config `32x32` or `64x64`).
      data_dir: TFDS data dir; None means `$TFDS_DATA_DIR` if set, else
        `~/tensorflow_datasets`.
      num_train: train examples, None for the config's default. A smaller build is
        a prefix of the full one, prepared under its own config name.
      num_test: test examples, None for the config's default.
      shuffle_files: passed to `as_dataset`.

    Returns:
      A `tf.data.Dataset` of {"image": uint8 [size, size, 3], "label": int64, "id": int64}.
    """
    builder = Shapes(config=shapes_config(size, num_train, num_test), data_dir=data_dir)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder.as_dataset(split=split, shuffle_files=shuffle_files)
