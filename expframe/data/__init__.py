"""Datasets for expframe experiments.

Submodules are imported on demand, so that `import expframe.data` stays cheap:

- `expframe.data.shapes`: `shapes`, an offline TFDS builder that generates labelled
  images of geometric shapes locally (tests, the quickstart, GAN metrics).
  Importing the module registers the builder with TFDS.
"""
