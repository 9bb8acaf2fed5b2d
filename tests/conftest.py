"""Test session set-up: split the CPU before any TensorFlow op runs, quiet logs."""

import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TFDS_DISABLE_GCS", "1")

import expframe  # noqa: E402

# Distribution tests run 1 to 8 replicas in this one process; TensorFlow lets a
# process split its CPU only once, so do it first.
expframe.split_cpu(8)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A TFDS data dir with a small `shapes` build (512 train / 64 test) for main.py runs."""
    path = tmp_path_factory.mktemp("tfds")
    from expframe.data import shapes  # pylint: disable=import-outside-toplevel
    for split in ("train", "test"):
        shapes.load_shapes(split, size=32, data_dir=str(path), num_train=512, num_test=64)
    return path
