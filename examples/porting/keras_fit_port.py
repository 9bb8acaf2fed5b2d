"""The port's only Python (docs/porting.md, second port): the original's compiled-model
builder, unchanged, made known to gin as `@keras_fit.build_model` (keras_fit.gin)."""

import gin
import keras_fit

gin.external_configurable(keras_fit.build_model, module="keras_fit")
