"""Optimizers for DTensor variables on a mesh: slots carry their variable's layout.

Keras 3 optimizers create their slots as plain tensors, which cannot hold a shard
of a DTensor kernel; these create each slot with `mesh.variable_like`, so a slot of
a kernel split over `model` is split the same way (a device holds 1/m of the
kernel and 1/m of its moments). Gradients are laid out as their variable before
the update (for a replicated variable, the batch-sharded contributions are summed
over `batch` there: the data-parallel all-reduce).
"""

from typing import Callable, List, Optional, Sequence, Union

import gin
import tensorflow as tf
from tensorflow.experimental import dtensor

from expframe.errors import ConfigError
from expframe.replicator import mesh

LearningRate = Union[float, Callable[[tf.Tensor], tf.Tensor]]


@gin.configurable
class MeshAdam(tf.Module):
    """Adam (or AdamW with `weight_decay`) over DTensor variables; SGD with momentum
    when `beta_2` is None (then `beta_1` is the momentum).

    Example:
      opt = MeshAdam(learning_rate=1e-3)
      opt.build(model.trainable_variables)           # eagerly, once
      opt.apply(grads, model.trainable_variables)    # inside the step

    Args:
      learning_rate: a float or a schedule `step -> rate` (a Keras schedule works); as in
        Keras, the schedule gets the number of updates before this one (0 at the first).
      beta_1: first-moment decay (momentum for SGD).
      beta_2: second-moment decay; None for SGD with momentum.
      epsilon: Adam's denominator term.
      weight_decay: decoupled weight decay per step, times the learning rate (AdamW).
    """

    def __init__(self, learning_rate: LearningRate = 1e-3, beta_1: float = 0.9,
                 beta_2: Optional[float] = 0.999, epsilon: float = 1e-7, weight_decay: float = 0.0,
                 name: str = "mesh_adam"):
        super().__init__(name=name)
        if not callable(learning_rate) and (not isinstance(learning_rate, (int, float)) or learning_rate <= 0):
            raise ConfigError(f"MeshAdam.learning_rate={learning_rate!r} must be a positive number or a schedule.")
        self.learning_rate, self.beta_1, self.beta_2 = learning_rate, beta_1, beta_2
        self.epsilon, self.weight_decay = epsilon, weight_decay
        self.iterations = None
        self.slots: List[List[tf.Variable]] = []
        self._layouts: List[dtensor.Layout] = []

    def build(self, variables: Sequence[tf.Variable]) -> None:
        """Creates the step counter and slots (eagerly, on the variables' mesh)."""
        if self.iterations is not None:
            return
        variables = list(variables)
        if not variables:
            raise ValueError("MeshAdam.build: no variables.")
        self._layouts = [dtensor.fetch_layout(v) for v in variables]
        first = self._layouts[0].mesh
        self.iterations = dtensor.DVariable(mesh.put(tf.constant(0, tf.int64), [], first),
                                            name="iterations", trainable=False)
        names = ("m", "v") if self.beta_2 is not None else ("momentum",)
        self.slots = [[mesh.variable_like(v, name=f"{n}_{i}") for n in names] for i, v in enumerate(variables)]

    def _rate(self, step: tf.Tensor) -> tf.Tensor:
        """The rate of the update that follows `step` updates (Keras' convention: a
        schedule sees 0 at the first update)."""
        if callable(self.learning_rate):
            return tf.cast(self.learning_rate(step), tf.float32)
        return tf.constant(self.learning_rate, tf.float32)

    def apply(self, grads: Sequence[tf.Tensor], variables: Sequence[tf.Variable]) -> None:
        """One update of `variables` (as given to `build`) from `grads`."""
        if self.iterations is None:
            raise RuntimeError("MeshAdam.apply before build(): build it eagerly with the variables first.")
        # The schedule sees the count before this update (as Keras optimizers pass it);
        # Adam's bias correction counts this update (t = 1 at the first).
        rate = self._rate(self.iterations.read_value())
        step = self.iterations.assign_add(1)
        t = tf.cast(step, tf.float32)
        for var, grad, slots, var_layout in zip(variables, grads, self.slots, self._layouts, strict=True):
            grad = dtensor.relayout(grad, var_layout)
            # The new slot values are used as computed, not read back after the assign: a
            # read after an assign of a DTensor variable on a mesh with batch > 1 saw the
            # old value for rank-1 variables (TF 2.21), leaving them untrained.
            if self.beta_2 is None:
                (mom,) = slots
                update = self.beta_1 * mom + grad
                mom.assign(update)
            else:
                m, v = slots
                m_new = self.beta_1 * m + (1 - self.beta_1) * grad
                v_new = self.beta_2 * v + (1 - self.beta_2) * tf.square(grad)
                m.assign(m_new)
                v.assign(v_new)
                m_hat = m_new / (1 - tf.pow(self.beta_1, t))
                v_hat = v_new / (1 - tf.pow(self.beta_2, t))
                update = m_hat / (tf.sqrt(v_hat) + self.epsilon)
            if self.weight_decay:
                update = update + self.weight_decay * var
            var.assign_sub(rate * update)
