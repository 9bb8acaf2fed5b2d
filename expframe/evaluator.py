"""Evaluation: the task's `evaluate(runner)`, by default an exact masked pass over the
eval split (every example once, at any batch and replica count)."""

from typing import Dict, Optional, Tuple

import numpy as np
import tensorflow as tf

from expframe.data import masked
from expframe.errors import ConfigError, RunError
from expframe.tasks.base import Task, check_step_output, contract_error

_REAL = "_real_examples"


class Evaluator:
    """Evaluates a Task; it is the `runner` that `Task.evaluate(runner)` receives.

    Args:
      replicator: the run's Replicator.
      task: the Task (built).
      global_batch_size: examples per eval step over all replicas.
      eval_steps: eval batches per evaluation (None: one exact pass over the split).
    """

    def __init__(self, replicator, task: Task, global_batch_size: int, eval_steps: Optional[int]):
        self.replicator = replicator
        self.task = task
        self.global_batch_size = global_batch_size
        self.eval_steps = eval_steps
        self._asynchronous = replicator.coordinator is not None
        self.step = 0  # the step being evaluated (see `evaluate`)
        # Takes a plain iterator, so a new evaluation's iterator does not retrace it.
        self._eval_step = tf.function(self._eval_body)

    def run(self, out, step: int) -> Dict[str, float]:
        """Evaluates at `step`: logs the metrics and the chief writes the task's artefacts."""
        metrics = self.evaluate(step)
        self.record(out, step, metrics)
        return metrics

    def evaluate(self, step: int) -> Dict[str, float]:
        """The task's metrics of the state at `step` (`Task.evaluate(runner)`; `runner.step`
        is the step, for a task whose evaluation draws random numbers: D4PG seeds its
        evaluation episodes from the run's seed and the step)."""
        self.step = int(step)
        return self.task.evaluate(self) or {}

    def record(self, out, step: int, metrics: Dict[str, float]) -> None:
        """Logs an evaluation's metrics (metrics.jsonl, TensorBoard, the progress line) and
        the chief writes the task's artefacts (`Task.write_outputs`)."""
        if metrics:
            out.log_metrics(step, "eval", metrics)
            out.progress("eval at step {}: {}".format(
                step, "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())))
        if self.replicator.is_chief:
            self.task.write_outputs(out.model_dir, step)

    def evaluate_by_steps(self) -> Optional[Dict[str, float]]:
        """Sums of the task's eval_step over the eval data, divided by the example count.

        With `eval_steps` None: one exact pass, every example once (see
        expframe/data/masked.py); else `eval_steps` batches, cycling the data.
        """
        summed = self.evaluate_sums()
        if summed is None:
            return None
        totals, count = summed
        return {k: float(v) / count for k, v in totals.items()}

    def evaluate_sums(self) -> Optional[Tuple[Dict[str, np.ndarray], float]]:
        """The task's eval_step outputs summed over replicas and eval batches, and the count.

        As `evaluate_by_steps`, before the division: for a task whose metrics are not
        means of its sums (a compiled Keras metric's state, expframe/tasks/keras_model.py).
        An output may be a tensor of any shape, summed element by element.

        Returns:
          ({name: sum}, the examples counted), or None without eval data.
        """
        rep = self.replicator
        workers = 1 if self._asynchronous else rep.num_workers
        ctx = tf.distribute.InputContext(workers, rep.worker_index, rep.num_replicas)
        dataset = self.task.eval_input_fn(ctx)
        if dataset is None:
            return None
        full_pass = self.eval_steps is None
        if full_pass and dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise ConfigError("Trainer.eval_steps is None (one pass over the eval data) but the eval "
                              "data repeats forever; set Trainer.eval_steps or stop repeating it.")
        per_replica = self.global_batch_size // rep.num_replicas
        try:
            batches = masked.masked_batches(dataset, per_replica, full_pass)
        except TypeError as e:
            raise ConfigError(f"{type(self.task).__name__}.eval_input_fn: {e}") from None
        if self._asynchronous:
            iterator = iter(batches)
        else:
            iterator = rep.distribute(lambda _: batches).plain_iterator()
        totals, steps = {}, 0
        while True:  # a full pass ends at the first step without a real example on any replica
            try:
                sums = {k: np.asarray(v, np.float64) for k, v in self._eval_step(rep.step_input(iterator)).items()}
            except Exception as e:  # noqa: BLE001  (re-raised: the contract's one line, or as it came)
                if contract_error(self.task, e) is e:
                    raise
                raise contract_error(self.task, e) from None
            if full_pass and sums[_REAL] == 0:
                break
            totals = {k: totals.get(k, 0.0) + v for k, v in sums.items()}
            steps += 1
            if not full_pass and steps == self.eval_steps:
                break
        real = float(totals.pop(_REAL, 0.0))
        if real == 0:
            raise ConfigError(f"{type(self.task).__name__}: the eval data is empty; check its split "
                              "or set ClassificationTask.eval_split = None for no evaluation.")
        if totals.get("count") != real:
            raise RunError(f"{type(self.task).__name__}.eval_step returned count={totals.get('count')} for "
                           f"{real:.0f} real examples: weight its sums and count by batch['{masked.MASK}'].")
        count = float(totals.pop("count"))
        return totals, count

    def _eval_body(self, iterator):
        """One eval step on every replica: the task's sums plus the real example count."""
        def step(batch):
            out = dict(check_step_output(
                self.task, "eval_step", self.task.eval_step(batch), "count",
                "an eval step returns a dict of per-replica sums, each example weighted by batch['mask'], "
                "with the key 'count' (the sum of the mask)"))
            out[_REAL] = tf.reduce_sum(tf.cast(batch[masked.MASK], tf.float32))
            return out

        if self._asynchronous:  # parameter_server: inline on the coordinator, reading the ps variables
            return step(next(iterator))
        return self.replicator.reduce(self.replicator.run(step, self.replicator.next_from(iterator)), "sum")
