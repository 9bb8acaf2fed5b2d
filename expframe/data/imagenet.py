"""ImageNet (ILSVRC 2012) input pipeline: TFDS `imagenet2012` + standard preprocessing.

Data. ImageNet cannot be downloaded automatically: put ILSVRC2012_img_train.tar and
ILSVRC2012_img_val.tar in the manual dir (`imagenet_input.manual_dir`, default
`<data_dir>/downloads/manual`); the first call prepares the TFDS dataset under
`imagenet_input.data_dir` (default `$TFDS_DATA_DIR` or `~/tensorflow_datasets`).
Nothing touches the network: TFDS's GCS lookups are off (`try_gcs=False`,
`try_download_gcs=False`; TFDS 4.9.10 also disables GCS by default).

Preprocessing (the ResNet recipe of Goyal et al. 2017 and torchvision):
  train: Inception-style random-resized crop (area 8%-100% of the image, aspect 3/4
    to 4/3, up to 10 tries, else the whole image), decoded from the JPEG directly
    with `decode_and_crop_jpeg` (only the crop is decoded), bilinear resize to
    image_size, random horizontal flip.
  eval: resize the shorter side to image_size / 0.875 (256 for 224), centre crop.
  both: per-channel (x - mean) / std with ImageNet's statistics on the [0, 255] scale.
Order (training): the index-based global order of expframe/data/order.py, so a run
resumes from its data position (global examples consumed, `ctx.start_example`) at
any worker and replica count with nothing to save but that number: the prepared
split's files are read in the seekable shuffled order of expframe/data/records.py
(`num_streams` interleaved streams, each file shuffled in blocks; together about
`shuffle_buffer_size` records are held for shuffling), and mock data, held in
memory, in a new permutation every epoch. Randomness is stateless, seeded per
example by (seed, global position), so the pipeline is reproducible at any
parallelism and topology.

Mock mode (`use_mock=True`): `tfds.testing.mock_data` makes random examples with the
real feature spec (encoded JPEG images, labels in [0, 1000)) without any files; they
are held in memory. For tests and speed runs only (the images are small and random).

Example, as a task's input_fn:
    def input_fn(ctx):
        return imagenet_input("train", ctx, batch_size=ctx.get_per_replica_batch_size(1024))

Gin (with ClassificationTask, which passes split, ctx, batch size, seed):
    ClassificationTask.dataset = @imagenet_input
    ClassificationTask.eval_split = 'validation'
    imagenet_input.data_dir = '/data/tfds'
"""

import functools
import os
from typing import Optional, Tuple

import gin
import tensorflow as tf
import tensorflow_datasets as tfds

from expframe.data import order, raw_images, records
from expframe.errors import ConfigError

MEAN_RGB = (123.675, 116.28, 103.53)  # ImageNet per-channel mean, [0, 255] scale
STDDEV_RGB = (58.395, 57.12, 57.375)  # and standard deviation
CROP_FRACTION = 0.875                 # eval: centre crop 224 of 256
AREA_RANGE = (0.08, 1.0)
ASPECT_RATIO_RANGE = (3.0 / 4.0, 4.0 / 3.0)
MAX_CROP_ATTEMPTS = 10
MANUAL_FILES = ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar")
NUM_CLASSES = 1000


def random_crop_window(image_shape: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
    """[offset_y, offset_x, height, width] of a random-resized crop of an image.

    Args:
      image_shape: int32 [height, width, channels].
      seed: int [2], a stateless seed.
    """
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        image_shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed,
        min_object_covered=0.0,  # let area_range alone bound the crop's area
        aspect_ratio_range=ASPECT_RATIO_RANGE, area_range=AREA_RANGE,
        max_attempts=MAX_CROP_ATTEMPTS, use_image_if_no_bounding_boxes=True)
    return tf.stack([begin[0], begin[1], size[0], size[1]])


def _image_shape(image: tf.Tensor) -> tf.Tensor:
    if image.dtype == tf.string:
        return tf.image.extract_jpeg_shape(image)
    return tf.shape(image)


def _crop(image: tf.Tensor, window: tf.Tensor) -> tf.Tensor:
    """Crops encoded JPEG bytes (decoding only the window) or a decoded uint8 image."""
    if image.dtype == tf.string:
        return tf.image.decode_and_crop_jpeg(image, window, channels=3)
    return tf.slice(image, [window[0], window[1], 0], [window[2], window[3], 3])


def _normalise(image: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    image = (tf.cast(image, tf.float32) - MEAN_RGB) / STDDEV_RGB
    return tf.cast(image, dtype)


def preprocess_for_train(image: tf.Tensor, seed: tf.Tensor, image_size: int = 224,
                         dtype: tf.DType = tf.float32) -> tf.Tensor:
    """Random-resized crop, flip and normalisation of one image.

    Args:
      image: JPEG bytes (scalar string) or a decoded uint8 [H, W, 3] image.
      seed: int [2] stateless seed; the same seed gives the same output.
      image_size: side of the square output.
      dtype: output dtype.

    Returns:
      [image_size, image_size, 3] tensor of `dtype`, normalised by MEAN_RGB/STDDEV_RGB.
    """
    seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), num=2)
    window = random_crop_window(_image_shape(image), seeds[0])
    crop = _crop(image, window)
    crop = tf.image.resize(crop, [image_size, image_size], method="bilinear", antialias=True)
    crop = tf.image.stateless_random_flip_left_right(crop, seeds[1])
    return tf.ensure_shape(_normalise(crop, dtype), [image_size, image_size, 3])


def centre_crop_window(image_shape: tf.Tensor, image_size: int = 224) -> Tuple[tf.Tensor, tf.Tensor]:
    """(window, resized side): the centre square that, resized so its side is
    image_size / 0.875 on the image's shorter side, leaves an image_size crop.

    Cropping first and resizing the crop is the same as resizing the whole image to
    shorter side round(image_size / 0.875) and then taking the centre image_size square,
    but decodes and resizes fewer pixels.
    """
    h, w = tf.cast(image_shape[0], tf.float32), tf.cast(image_shape[1], tf.float32)
    resized_short = float(round(image_size / CROP_FRACTION))
    # Side of the crop in original pixels: image_size out of resized_short on the short side.
    side = tf.cast(tf.round(tf.minimum(h, w) * image_size / resized_short), tf.int32)
    side = tf.maximum(side, 1)
    offset_y = (image_shape[0] - side) // 2
    offset_x = (image_shape[1] - side) // 2
    return tf.stack([offset_y, offset_x, side, side])


def preprocess_for_eval(image: tf.Tensor, image_size: int = 224, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """Centre crop (short side image_size / 0.875, crop image_size) and normalisation.

    Args:
      image: JPEG bytes (scalar string) or a decoded uint8 [H, W, 3] image.
      image_size: side of the square output.
      dtype: output dtype.

    Returns:
      [image_size, image_size, 3] tensor of `dtype`; deterministic.
    """
    crop = _crop(image, centre_crop_window(_image_shape(image), image_size))
    crop = tf.image.resize(crop, [image_size, image_size], method="bilinear", antialias=True)
    return tf.ensure_shape(_normalise(crop, dtype), [image_size, image_size, 3])


def preprocess_encoded_for_eval(encoded: tf.Tensor, image_size: int = 224,
                                dtype: tf.DType = tf.float32) -> tf.Tensor:
    """`preprocess_for_eval` of any encoded image: JPEG bytes as the eval pipeline reads
    the dataset's (decoding only the crop window), other formats (PNG, GIF, BMP) decoded
    whole first."""
    return tf.cond(tf.io.is_jpeg(encoded), lambda: preprocess_for_eval(encoded, image_size, dtype),
                   lambda: preprocess_for_eval(raw_images.decode_image(encoded), image_size, dtype))


def _builder(data_dir: Optional[str]) -> tfds.core.DatasetBuilder:
    return tfds.builder("imagenet2012", data_dir=data_dir, try_gcs=False)


def prepare(data_dir: Optional[str] = None, manual_dir: Optional[str] = None,
            num_input_pipelines: int = 1) -> tfds.core.DatasetBuilder:
    """The `imagenet2012` builder, preparing the dataset from the manual dir if needed.

    Raises:
      ConfigError: the dataset is not prepared and the tar files are not in the
        manual dir, or several input pipelines would prepare it at once.
    """
    builder = _builder(data_dir)
    if builder.is_prepared():
        return builder
    root = os.path.dirname(os.path.dirname(builder.data_dir))  # <root>/imagenet2012/<version>
    manual_dir = manual_dir or os.path.join(root, "downloads", "manual")
    missing = [f for f in MANUAL_FILES if not tf.io.gfile.exists(os.path.join(manual_dir, f))]
    if missing:
        raise ConfigError(
            f"imagenet2012 is not prepared in {root} and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not in the manual dir {manual_dir}: download "
            f"{' and '.join(MANUAL_FILES)} from https://image-net.org/download-images into {manual_dir} "
            f"(or set imagenet_input.manual_dir), set imagenet_input.data_dir to where the prepared "
            f"dataset should live, or bind imagenet_input.use_mock = True for fake data.")
    if num_input_pipelines > 1:
        raise ConfigError(
            f"imagenet2012 is not prepared in {root}; prepare it once before a multi-worker run: "
            f"tfds build imagenet2012 --data_dir={root} --manual_dir={manual_dir}")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(
        manual_dir=manual_dir, try_download_gcs=False))
    return builder


@functools.lru_cache(maxsize=8)
def _mock_arrays(split: str, num_examples: int, data_dir: Optional[str]) -> Tuple[tuple, tuple]:
    with tf.init_scope(), tfds.testing.mock_data(num_examples=num_examples):
        mocked = _builder(data_dir).as_dataset(
            split=split, decoders={"image": tfds.decode.SkipDecoding()})
        examples = list(mocked.map(lambda ex: (ex["image"], ex["label"])).as_numpy_iterator())
    return tuple(zip(*examples, strict=True))


def _mock_examples(split: str, num_examples: int, data_dir: Optional[str]) -> tf.data.Dataset:
    """`num_examples` random examples with the real features, held in memory, in order."""
    images, labels = _mock_arrays(split, num_examples, data_dir)
    return tf.data.Dataset.from_tensor_slices({"image": list(images), "label": list(labels)})


def _mock_train(split: str, num_examples: int, data_dir: Optional[str], positions: tf.data.Dataset,
                seed: int) -> tf.data.Dataset:
    """(position, example) in the per-epoch permutations of the mock examples."""
    images, labels = _mock_arrays(split, num_examples, data_dir)
    images, labels = tf.constant(list(images)), tf.constant(list(labels))

    def example(position):
        index = order.shuffled_index(position, len(labels), seed)
        return position, {"image": tf.gather(images, index), "label": tf.gather(labels, index)}

    return positions.map(example)


def _disk_train(builder: tfds.core.DatasetBuilder, split: str, ctx: tf.distribute.InputContext,
                start: int, seed: int, num_streams: int, block_size: int) -> tf.data.Dataset:
    """(position, example) of the prepared split, read in the seekable order of records.py."""
    stream = records.stream_records(records.tfds_files(builder, split), start, ctx.input_pipeline_id,
                                    ctx.num_input_pipelines, seed, num_streams, block_size)
    stream = order.in_step_shard(ctx, start, stream)  # tf.data service: this shard's steps, still unparsed
    features = builder.info.features
    decoders = {"image": tfds.decode.SkipDecoding()}

    def example(position, record):
        ex = features.deserialize_example(record, decoders=decoders)
        return position, {"image": ex["image"], "label": ex["label"]}

    return stream.map(example, num_parallel_calls=tf.data.AUTOTUNE)


@gin.configurable
def imagenet_input(split: str = "train",
                   ctx: Optional[tf.distribute.InputContext] = None,
                   batch_size: int = gin.REQUIRED,
                   training: Optional[bool] = None,
                   seed: Optional[int] = None,
                   deterministic: bool = False,
                   data_dir: Optional[str] = None,
                   manual_dir: Optional[str] = None,
                   image_size: int = 224,
                   dtype: str = "float32",
                   shuffle_buffer_size: int = 10_000,
                   num_streams: int = 16,
                   use_mock: bool = False,
                   mock_num_examples: int = 256) -> tf.data.Dataset:
    """This input pipeline's share of ImageNet, in per-replica batches.

    The signature is the dataset contract of `ClassificationTask.dataset`: the task
    passes split, ctx, batch_size, training, seed and deterministic; gin binds the rest.

    Args:
      split: a TFDS split of imagenet2012 ("train", "validation", "train[:1%]", ...).
      ctx: the InputContext given to `input_fn`. Training: this pipeline takes every
        `ctx.num_input_pipelines`-th example of the global order from
        `ctx.start_example` (0 if absent) on; eval: every
        `ctx.num_input_pipelines`-th file. None: one pipeline.
      batch_size: examples per batch, i.e. per replica
        (`ctx.get_per_replica_batch_size(global_batch_size)`).
      training: train preprocessing, shuffling and repetition (True) or eval
        preprocessing, file order, one pass (False); default: split starts with "train".
      seed: seed of the example order and augmentation (the same for every pipeline:
        the order is global); None: random, unless `deterministic`, which then uses 0.
      deterministic: seed every random choice (seed 0 if None) and keep the eval
        element order (the train order is always deterministic: resume relies on it).
      data_dir: TFDS data dir (None: the TFDS default).
      manual_dir: where the ILSVRC2012 tar files are (None: `<data_dir>/downloads/manual`).
      image_size: side of the square images.
      dtype: image dtype ("float32", "bfloat16", "float16").
      shuffle_buffer_size: records held for shuffling (training only): each of the
        `num_streams` streams shuffles blocks of shuffle_buffer_size / num_streams.
      num_streams: interleaved streams the split's files are dealt into (training).
      use_mock: fake examples from `tfds.testing.mock_data`, no files needed.
      mock_num_examples: number of fake examples per split (before sharding).

    Returns:
      A dataset of {"image": [batch_size, image_size, image_size, 3] `dtype`,
      "label": [batch_size] int32}; when training repeated, remainder dropped;
      for eval one pass with the partial last batch kept.

    Raises:
      ConfigError: dataset not available (see `prepare`) or batch_size < 1.
    """
    ctx = ctx or tf.distribute.InputContext()
    training = split.startswith("train") if training is None else training
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"imagenet_input: batch_size={batch_size!r} must be a positive integer.")
    if not isinstance(num_streams, int) or num_streams < 1:
        raise ConfigError(f"imagenet_input.num_streams={num_streams!r} must be a positive integer.")
    if deterministic and seed is None:
        seed = 0
    dtype = tf.as_dtype(dtype)
    if training:
        seed = order.resolve_seed(seed)
        start = order.start_example(ctx)
        if use_mock:
            ds = _mock_train(split, mock_num_examples, data_dir, order.positions(ctx, start), seed)
        else:
            builder = prepare(data_dir, manual_dir, ctx.num_input_pipelines)
            ds = _disk_train(builder, split, ctx, start, seed, num_streams,
                             max(1, shuffle_buffer_size // num_streams))
        ds = ds.map(
            lambda position, ex: {
                "image": preprocess_for_train(ex["image"], order.example_seed(seed, position), image_size, dtype),
                "label": tf.cast(ex["label"], tf.int32)},
            num_parallel_calls=tf.data.AUTOTUNE)
    else:
        if use_mock:
            ds = _mock_examples(split, mock_num_examples, data_dir)
            ds = ds.shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
        else:
            builder = prepare(data_dir, manual_dir, ctx.num_input_pipelines)
            ds = builder.as_dataset(
                split=split, shuffle_files=False, decoders={"image": tfds.decode.SkipDecoding()},
                read_config=tfds.ReadConfig(input_context=ctx, try_autocache=False))
        ds = ds.map(lambda ex: {"image": preprocess_for_eval(ex["image"], image_size, dtype),
                                "label": tf.cast(ex["label"], tf.int32)},
                    num_parallel_calls=tf.data.AUTOTUNE)
    # Eval keeps the partial last batch: the trainer pads it (expframe/data/masked.py).
    ds = ds.batch(batch_size, drop_remainder=training).prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.deterministic = True if training else deterministic
    return ds.with_options(options)


def _imagenet_raw_images(arguments) -> raw_images.RawImages:
    """imagenet_input's eval preprocessing, in its `dtype` and handed on as float32 (which
    holds bfloat16 and float16 exactly); the class names (WordNet ids) from TFDS's
    imagenet2012 info, which needs no data."""
    size, dtype = arguments["image_size"], tf.as_dtype(arguments["dtype"])
    names = _builder(arguments["data_dir"]).info.features["label"].names
    return raw_images.RawImages(
        preprocess=lambda image: tf.cast(preprocess_for_eval(image, size, dtype), tf.float32),
        decode=lambda encoded: tf.cast(preprocess_encoded_for_eval(encoded, size, dtype), tf.float32),
        class_names=tuple(names))


raw_images.declare(imagenet_input, _imagenet_raw_images)
