"""Test session set-up: split the CPU before any TensorFlow op runs, quiet logs."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TFDS_DISABLE_GCS", "1")

import expframe  # noqa: E402

# Distribution tests run 1 to 8 replicas in this one process; TensorFlow lets a
# process split its CPU only once, so do it first.
expframe.split_cpu(8)
