"""A Keras 3 optimizer wrapper that aggregates gradients across replicas correctly.

What it fixes (TF 2.21 / Keras 3.15, MirroredStrategy, custom loops):
  * Keras' `apply_gradients` in replica context SUMS gradients over replicas. A
    per-replica loss written as a mean must be AVERAGED to match one device on the
    global batch. The wrapper does one (packed) cross-replica mean itself and turns
    Keras' own reduction off for its optimizer, so gradients are aggregated once.
  * Clipping by global norm must see the global gradient: it happens after the
    cross-replica mean (clipping per replica first gives a different update).
  * Slot variables created lazily inside the first traced step fail ("You must feed
    a value for placeholder tensor"). The wrapper builds the optimizer on first use
    by stepping out to cross-replica context (merge_call) and eager mode (init_scope).
  * `accumulate_steps=k`: each replica sums its local gradients of k micro-batches in
    sync-on-read accumulators (no communication), then one mean over replicas and
    micro-batches updates the weights: k micro-batches of size b update exactly as
    one batch of size k*b. The conditional update (apply on every k-th micro-batch,
    or skip a non-finite one) lives inside `apply_gradients`: a collective cannot
    sit inside a `tf.cond` in replica context, so `apply_gradients` steps out to
    cross-replica context with `merge_call`, decides there once for all replicas,
    and runs the reduction and the update in each replica from the chosen branch
    (the pattern of Keras 2's LossScaleOptimizer). It works whoever launches the
    step: `Replicator.run`, `strategy.run`, one step or a loop of them.
  * `loss_scale`: a fixed float, or "dynamic" (float16): gradients of the scaled
    loss are unscaled in `apply_gradients`; a non-finite global gradient skips the
    update and halves the scale, `growth_interval` finite steps double it. The
    forward pass of a skipped step has run, so batch-norm moving statistics are
    updated from it (as with Keras 2's LossScaleOptimizer).
  * Forgetting to scale cannot pass silently. `minimize(loss, variables, tape)` does
    the whole update (scale, gradients, unscale, average, clip, apply) and is the way
    tasks should use; `scale_loss` still works for hand-written gradients. With loss
    scaling on, `apply_gradients` refuses, while its step is traced, gradients that
    were not computed from `scale_loss`'s output or by `minimize`, and gradients of a
    partly scaled loss (`scale_loss(ce) + l2`): the graph is walked back from each
    gradient, into nested tf.functions, conds and while loops (`scale_provenance.py`).
    Eagerly, the tape that computed the gradients must have gone through a scale. The
    refusal is a ConfigError naming the calling step function and the fix (main.py:
    one line, exit 2; the trainer traces the step before it writes anything). As
    PyTorch's GradScaler.step() refuses an optimizer whose gradients it did not scale.
  * The porting traps cannot pass silently either (`loss_provenance.py`): while the step
    is traced, `apply_gradients` refuses a loss already divided across replicas
    (`tf.nn.compute_average_loss`, a read of `num_replicas_in_sync`, a Keras loss object
    that divides by the replicas) unless `allow_divided_loss`, and a variable's
    regularisation loss (`model.losses`) that the step never read unless
    `allow_unread_model_losses`.
  * It overrides Keras' private `_all_reduce_sum_gradients`; importing this module
    checks that Keras still has and calls it (expframe/replicator/keras_hooks.py).
"""

import inspect
import os
from typing import Callable, Iterable, Optional, Sequence, Union

import gin
import keras
import tensorflow as tf

from expframe.errors import ConfigError
from expframe.replicator import collectives, keras_hooks, loss_provenance
from expframe.replicator.scale_provenance import ScaleProvenance


def check_keras_hooks() -> None:
    """Fails at import on a Keras whose optimizer no longer sums gradients through the
    hook that the wrapper turns off (see keras_hooks.py)."""
    keras_hooks.require_hook(
        keras.optimizers.Optimizer, "_all_reduce_sum_gradients", "wrap_optimizer",
        "Keras would sum the already averaged gradients again over the replicas "
        "(updates N times too large)", called_by="_backend_update_step")


check_keras_hooks()


_HERE = os.path.dirname(os.path.realpath(__file__))


def _is_replicator_frame(frame) -> bool:
    """A frame of this package's code, also as AutoGraph's converted copy (which runs
    from a generated file, so it is recognised by its `self` or its module)."""
    owner = frame.f_locals.get("self")
    module = type(owner).__module__ if owner is not None else frame.f_globals.get("__name__", "")
    return os.path.realpath(frame.f_code.co_filename).startswith(_HERE) or module.startswith(__package__)


@tf.autograph.experimental.do_not_convert
def _calling_step() -> str:
    """The user code that called apply_gradients, e.g. `D4PGTask.train_step`: the first
    frame outside this package, TensorFlow and Keras (AutoGraph's copy of a step is
    named `tf__<name>`)."""
    frame = inspect.currentframe()
    while frame is not None:
        path = os.path.realpath(frame.f_code.co_filename)
        library = any(f"{os.sep}{name}{os.sep}" in path for name in ("tensorflow", "keras", "tf_keras"))
        name = frame.f_code.co_name
        generated = "__autograph_generated" in path
        # In AutoGraph's copy, `tf__<name>` is the function; `if_body`, `loop_body`... are
        # the pieces it cut its control flow into.
        if not library and not _is_replicator_frame(frame) and (not generated or name.startswith("tf__")):
            name = name[len("tf__"):] if generated else name
            owner = frame.f_locals.get("self")
            where = f"{type(owner).__name__}.{name}" if owner is not None else name
            if not generated:
                where += f" ({os.path.relpath(path)}:{frame.f_lineno})"
            elif owner is not None and inspect.getsourcefile(type(owner)):  # AutoGraph's copy: the class's file
                where += f" ({os.path.relpath(inspect.getsourcefile(type(owner)))})"
            return where
        frame = frame.f_back
    return "the step function"


class ReplicatedOptimizer(tf.Module):
    """See module docstring. Create it with `wrap_optimizer` inside `Replicator.scope()`."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, accumulate_steps: int = 1,
                 clip_global_norm: Optional[float] = None,
                 loss_scale: Union[None, float, str] = None, growth_interval: int = 2000,
                 allow_divided_loss: bool = False, allow_unread_model_losses: bool = False):
        super().__init__(name="replicated_optimizer")
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ConfigError(f"wrap_optimizer needs a Keras optimizer, got {type(optimizer).__name__}.")
        if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
            raise ConfigError(f"wrap_optimizer accumulate_steps={accumulate_steps!r} must be an integer >= 1.")
        if clip_global_norm is not None and not clip_global_norm > 0:
            raise ConfigError(f"wrap_optimizer clip_global_norm={clip_global_norm!r} must be > 0 or None.")
        if loss_scale is not None and loss_scale != "dynamic" and not (
                isinstance(loss_scale, (int, float)) and loss_scale > 0):
            raise ConfigError(f"wrap_optimizer loss_scale={loss_scale!r}: use None, a positive number or 'dynamic'.")
        for name, value in (("allow_divided_loss", allow_divided_loss),
                            ("allow_unread_model_losses", allow_unread_model_losses)):
            if not isinstance(value, bool):
                raise ConfigError(f"wrap_optimizer.{name}={value!r} must be True or False.")
        from_policy = loss_scale is None and keras.mixed_precision.global_policy().name == "mixed_float16"
        if from_policy:
            loss_scale = "dynamic"  # float16 gradients underflow without it.
        strategy = tf.distribute.get_strategy()
        if getattr(optimizer, "_distribution_strategy", strategy) is not strategy:
            raise ConfigError(
                "wrap_optimizer: the Keras optimizer was created outside the Replicator's scope; "
                "create it inside `with replicator.scope():` (its variables must be replicated).")
        if (accumulate_steps > 1 or loss_scale == "dynamic") and isinstance(
                strategy, tf.distribute.experimental.ParameterServerStrategy):
            what = (f"wrap_optimizer.accumulate_steps={accumulate_steps}" if accumulate_steps > 1 else
                    "run_experiment.precision='mixed_float16' (it turns on dynamic loss scaling)" if from_policy
                    else "wrap_optimizer.loss_scale='dynamic'")
            fix = ("set wrap_optimizer.accumulate_steps = 1" if accumulate_steps > 1 else
                   "use run_experiment.precision='mixed_bfloat16' or 'float32', or a fixed "
                   "wrap_optimizer.loss_scale" if from_policy else "use a fixed wrap_optimizer.loss_scale")
            raise ConfigError(
                f"{what} needs synchronous replicas (accumulation and dynamic loss scaling decide once for all "
                f"of them), which Replicator.target='parameter_server' does not have; {fix}, or another target.")
        self.optimizer = optimizer
        self.accumulate_steps = accumulate_steps
        self.clip_global_norm = clip_global_norm
        self.dynamic = loss_scale == "dynamic"
        self.growth_interval = growth_interval
        self.allow_divided_loss, self.allow_unread_model_losses = allow_divided_loss, allow_unread_model_losses
        object.__setattr__(self, "_strategy", strategy)
        # We aggregate; Keras must not sum again.
        optimizer._all_reduce_sum_gradients = lambda grads_and_vars: grads_and_vars
        self.loss_scale = None
        if loss_scale is not None:
            initial = 2.0 ** 15 if self.dynamic else float(loss_scale)
            self._initial_scale = initial
            self.loss_scale = tf.Variable(initial, trainable=False, name="loss_scale",
                                          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
            self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name="good_steps",
                                          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self._deferred = accumulate_steps > 1 or self.dynamic
        self.accumulators = []
        self.micro_step = None
        object.__setattr__(self, "_vars", None)
        object.__setattr__(self, "_provenance", ScaleProvenance())

    # -- Keras-like surface ------------------------------------------------------------

    @property
    def iterations(self) -> tf.Variable:
        """Number of weight updates applied (not micro-batches)."""
        return self.optimizer.iterations

    @property
    def learning_rate(self):
        return self.optimizer.learning_rate

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """Multiplies the loss by the loss scale (identity without loss scaling).

        Differentiate the result and pass those gradients to `apply_gradients`, which
        unscales them. `minimize` does all of it in one call.
        """
        if self.loss_scale is None:
            return loss
        return self._provenance.scaled_loss(loss, self._scale(loss.dtype))

    def _scale(self, dtype) -> tf.Tensor:
        """The loss scale as a tensor of `dtype`, recorded as a source of scaled gradients."""
        scale = tf.identity(tf.cast(self.loss_scale, dtype), name="loss_scale_value")
        self._provenance.record(scale)
        return scale

    def minimize(self, loss: Union[tf.Tensor, Callable[[], tf.Tensor]], variables: Sequence[tf.Variable],
                 tape: Optional[tf.GradientTape] = None) -> tf.Tensor:
        """The whole update: scales the loss, differentiates it, unscales, averages over
        replicas (and micro-batches), clips and applies. Use it in the step function.

        Args:
          loss: this replica's mean loss, computed under `tape`; or, without a tape, a
            function of no arguments that computes it (it runs under a new tape).
          variables: the variables to update (those the optimizer was built for).
          tape: the tape that recorded `loss`.

        Returns:
          The loss (unscaled).

        Example:
          with tf.GradientTape() as tape:
              loss = loss_fn(model(x, training=True), y)
          optimizer.minimize(loss, model.trainable_variables, tape)
        """
        variables = list(variables)
        if tape is None:
            if not callable(loss):
                raise ValueError("minimize: pass the tape that recorded the loss, or the loss as a function.")
            with tf.GradientTape() as tape:
                loss = loss()
        # d(s * loss)/dw, with s fed as the upstream gradient of the loss: nothing is
        # multiplied in the forward pass, and float16 gradients are scaled all the way.
        upstream = None if self.loss_scale is None else self._scale(loss.dtype)
        replicas = collectives.num_replicas()
        divided = upstream is None and replicas > 1
        if divided:
            # The mean over replicas is the sum of each replica's gradients of loss / N:
            # 1/N fed as the upstream gradient costs nothing, where dividing the summed
            # gradients is one more pass over all of them (ResNet-50: 25.6M floats, about
            # 1 % of its step on 2 CPU replicas; Keras fit scales its loss the same way).
            # Exact for a power-of-two N (a power-of-two scale commutes with every rounding).
            upstream = tf.constant(1.0 / replicas, loss.dtype)
        grads = tape.gradient(loss, variables, output_gradients=upstream)
        if upstream is not None and not divided and tf.executing_eagerly():
            self._provenance.count_backward_pass()  # this tape, this loss, scaled as the upstream gradient
        self._apply_replica_gradients(zip(grads, variables, strict=True), divided)
        return loss

    def build(self, var_list: list) -> None:
        """Creates slots and accumulators for `var_list` (call in the replicator's scope)."""
        if self._vars is not None:
            return
        # Not a checkpoint dependency: the variables belong to the model.
        object.__setattr__(self, "_vars", list(var_list))
        if not self.optimizer.built:
            self.optimizer.build(self._vars)
        if self._deferred:
            on_read = dict(synchronization=tf.VariableSynchronization.ON_READ, trainable=False)
            # SUM aggregation: a checkpoint holds the sum over replicas, and restoring into
            # M replicas gives each 1/M of it, so partial sums survive a change of replicas.
            self.accumulators = [
                tf.Variable(tf.zeros(v.shape, v.dtype), name="grad_accumulator",
                            aggregation=tf.VariableAggregation.SUM, **on_read) for v in self._vars]
            self.micro_step = tf.Variable(0, dtype=tf.int64, name="micro_step",
                                          aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA, **on_read)

    def _build_from_step(self, var_list):
        def build_in_cross_replica(strategy):
            with tf.init_scope(), strategy.scope():
                self.build(var_list)
        ctx = tf.distribute.get_replica_context()
        if ctx is None or not tf.distribute.has_strategy():
            with tf.init_scope():
                self.build(var_list)
        else:
            ctx.merge_call(build_in_cross_replica)

    # -- the update --------------------------------------------------------------------

    def apply_gradients(self, grads_and_vars: Iterable) -> None:
        """Averages gradients over replicas (and micro-batches) and updates the variables.

        Call it in the step function with this replica's gradients of its mean loss;
        with loss scaling on, gradients of `scale_loss(loss)` (they are unscaled here).
        `minimize` is the one call that does it all.

        Raises:
          ConfigError: loss scaling is on and a gradient does not come from
            `scale_loss` or `minimize`; the loss was divided across replicas; a
            regularisation loss of the variables was never read (checked while the
            step is traced).
        """
        self._apply_replica_gradients(grads_and_vars, divided=False)

    def _apply_replica_gradients(self, grads_and_vars: Iterable, divided: bool) -> None:
        """apply_gradients; `divided`: the gradients are already this replica's share of
        the mean over replicas (gradients of loss / N, from `minimize`), so the replicas'
        gradients are summed, not averaged."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError("apply_gradients got no gradients: is the loss connected to the variables?")
        grads = [tf.convert_to_tensor(g) for g, _ in pairs]
        variables = [v for _, v in pairs]
        if self._vars is None:
            self._build_from_step(variables)
        elif len(variables) != len(self._vars):
            raise ValueError(
                f"apply_gradients got {len(variables)} variables but the optimizer was built for "
                f"{len(self._vars)}; use one wrapped optimizer per set of variables.")
        loss_provenance.check(variables, _calling_step, self.allow_divided_loss, self.allow_unread_model_losses)
        if self.loss_scale is not None:
            self._require_scaled(grads, variables)
            grads = [g / tf.cast(self.loss_scale, g.dtype) for g in grads]
        if not self._deferred:
            grads = collectives.all_reduce(grads, "sum" if divided else "mean")
            self._apply(grads, variables)
            return
        ctx = tf.distribute.get_replica_context()
        if ctx is None and collectives.num_replicas() > 1:
            raise RuntimeError("ReplicatedOptimizer.apply_gradients must run inside the replicated "
                               "step (the step_fn given to Replicator.run or strategy.run).")
        # Each replica adds its share of the global mean (g / N), so that the sum over
        # replicas of the accumulators is the running total of global-mean gradients even
        # if a checkpoint taken mid-accumulation is restored into another replica count.
        share = 1.0 / collectives.num_replicas()
        for acc, g in zip(self.accumulators, grads, strict=True):
            acc.assign_add(g if divided else g * share)
        self.micro_step.assign_add(1)
        if ctx is None:  # one replica, cross-replica context: nothing to merge.
            self._update_in_cross_replica(tf.distribute.get_strategy())
        else:
            ctx.merge_call(self._update_in_cross_replica)

    @tf.autograph.experimental.do_not_convert
    def _require_scaled(self, grads, variables) -> None:
        unscaled, partly = self._provenance.check(grads)
        if not unscaled and not partly:
            return
        indices = unscaled or partly
        names = ", ".join(getattr(variables[i], "path", variables[i].name) for i in indices[:2])
        more = f" and {len(indices) - 2} more" if len(indices) > 2 else ""
        scale = "dynamic" if self.dynamic else f"{self._initial_scale:g}"
        if unscaled:
            error = ConfigError(
                f"{_calling_step()} passed gradients of an unscaled loss to apply_gradients ({names}{more}), but "
                f"loss scaling is on (loss_scale {scale}: run_experiment.precision='mixed_float16' or "
                f"wrap_optimizer.loss_scale), so float16 gradients underflow and every update would be divided by "
                f"the scale; update with `optimizer.minimize(loss, variables, tape)`, or differentiate "
                f"`optimizer.scale_loss(loss)`.")
        else:
            error = ConfigError(
                f"{_calling_step()} passed gradients of a partly scaled loss to apply_gradients ({names}{more}): "
                f"the loss it differentiated adds terms to `optimizer.scale_loss(...)`'s output that were not "
                f"scaled, and apply_gradients would divide them by the loss scale ({scale}); scale the whole "
                f"loss, `optimizer.scale_loss(loss + regulariser)`, or use `optimizer.minimize(loss, variables, "
                f"tape)`.")
        error.ag_pass_through = True  # AutoGraph would wrap it in a StagingError of several lines
        raise error

    def _clip(self, grads):
        if self.clip_global_norm is None:
            return grads
        clipped, _ = tf.clip_by_global_norm(grads, self.clip_global_norm)
        return clipped

    def _apply(self, grads, variables):
        self.optimizer.apply_gradients(zip(self._clip(grads), variables, strict=True))

    def _update_in_cross_replica(self, strategy):
        """Cross-replica (inside merge_call): when k micro-batches are in, mean them over
        replicas and apply unless non-finite. Every replica holds the same micro-step
        count and the same reduced finiteness, so the first replica's value decides for
        all; the branches run in each replica with `call_for_each_replica`."""
        local_step = strategy.experimental_local_results(self.micro_step)[0]
        for_each_replica = strategy.extended.call_for_each_replica

        def reduce_and_apply():
            def reduce_accumulated():
                summed = collectives.all_reduce([acc.read_value() for acc in self.accumulators], "sum")
                for acc, g in zip(self.accumulators, summed, strict=True):
                    acc.assign(g / self.accumulate_steps)
                if not self.dynamic:
                    return tf.constant(True)
                return tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in summed])

            finite = strategy.experimental_local_results(for_each_replica(reduce_accumulated))[0]

            def apply_accumulated():
                self._apply([acc.read_value() for acc in self.accumulators], self._vars)

            tf.cond(finite, lambda: _run_noop(for_each_replica, apply_accumulated),
                    lambda: tf.constant(0))

            def reset(is_finite):
                for acc in self.accumulators:
                    acc.assign(tf.zeros_like(acc))
                if self.dynamic:
                    self._update_scale(is_finite)

            for_each_replica(reset, args=(finite,))
            return tf.constant(0)

        tf.cond(local_step % self.accumulate_steps == 0, reduce_and_apply, lambda: tf.constant(0))

    def _update_scale(self, finite):
        grow = tf.logical_and(finite, self.good_steps + 1 >= self.growth_interval)
        scale = tf.where(finite, tf.where(grow, self.loss_scale * 2.0, self.loss_scale),
                         tf.maximum(self.loss_scale / 2.0, 1.0))
        self.loss_scale.assign(scale)
        self.good_steps.assign(tf.where(tf.logical_and(finite, tf.logical_not(grow)),
                                        self.good_steps + 1, tf.zeros_like(self.good_steps)))


def _run_noop(for_each_replica, fn):
    for_each_replica(fn)
    return tf.constant(0)


@gin.configurable
def wrap_optimizer(optimizer: keras.optimizers.Optimizer, accumulate_steps: int = 1,
                   clip_global_norm: Optional[float] = None,
                   loss_scale: Union[None, float, str] = None, allow_divided_loss: bool = False,
                   allow_unread_model_losses: bool = False) -> ReplicatedOptimizer:
    """Wraps a Keras optimizer for replicated training (see module docstring).

    Call inside `Replicator.scope()`, then use `apply_gradients` in the step function
    with each replica's gradients of its own mean loss.

    Args:
      optimizer: a Keras 3 optimizer created in the same scope.
      accumulate_steps: micro-batches summed per update (k batches of b == one of k*b).
      clip_global_norm: clip the replica-averaged gradient to this global norm.
      loss_scale: None, a fixed scale, or "dynamic". None becomes "dynamic" under the
        Keras policy "mixed_float16".
      allow_divided_loss: accept a step whose loss was divided across replicas
        (`tf.nn.compute_average_loss`, a read of `num_replicas_in_sync`, a Keras loss
        object with reduction 'sum_over_batch_size'), refused by default.
      allow_unread_model_losses: accept a step that never reads `model.losses` of the
        variables it updates (their regularizers then go untrained), refused by default.

    Returns:
      A `ReplicatedOptimizer`, checkpointable (slots, accumulators, loss scale).
    """
    return ReplicatedOptimizer(optimizer, accumulate_steps, clip_global_norm, loss_scale,
                               allow_divided_loss=allow_divided_loss,
                               allow_unread_model_losses=allow_unread_model_losses)
