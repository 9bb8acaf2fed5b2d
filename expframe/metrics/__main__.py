"""`python -m expframe.metrics [--data_dir=DIR] [--image_size=32]`: trains and caches the
shapes classifier used for FID on `shapes` (see expframe/metrics/shapes_classifier.py)."""

from expframe.metrics.shapes_classifier import main

if __name__ == "__main__":
    raise SystemExit(main())
