"""Plain Keras models (no hardware code): ResNet (resnet.py), and others by family."""
