"""Evaluation: the task's `evaluate(runner)`, by default an exact masked pass over the
eval split (every example once, at any batch and replica count).

Besides the run's own evaluation (`eval`, on the task's eval split: the run's eval
curve), a task may declare named evaluations of other data (`Task.named_evals`: e.g.
`eval_train`, the train split, bound as `ClassificationTask.evaluations`). Each runs the
task's same evaluation on its own data, and is recorded under its own name: its own
records in metrics.jsonl (`"split": "eval_train"`) and its own TensorBoard folder, never
in the `eval` curve.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from expframe.data import masked
from expframe.errors import ConfigError, RunError
from expframe.tasks.base import Task, check_step_output, contract_error

_REAL = "_real_examples"
MAIN = "eval"  # the run's own evaluation: its eval curve


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
        self._named = dict(task.named_evals())
        self._input_fn = None  # a named evaluation's data while it runs (see `evaluate`)
        # Takes a plain iterator, so a new evaluation's iterator does not retrace it.
        self._eval_step = tf.function(self._eval_body)

    def names(self) -> List[str]:
        """The evaluations of a step: the run's own (`eval`), then the named ones as bound."""
        return [MAIN, *self._named]

    def check_names(self, names: Sequence[str], flag: str = "--evaluation") -> List[str]:
        """`names` in `names()` order; ConfigError naming the flag for an unknown one."""
        for name in names:
            if name not in self.names():
                raise ConfigError(f"{flag}={name!r}: this run's evaluations are {', '.join(self.names())} "
                                  f"(named ones are bound as {type(self.task).__name__}.evaluations).")
        return [n for n in self.names() if n in names]

    def run(self, out, step: int) -> Dict[str, float]:
        """Evaluates at `step` (every evaluation), records them (`record_all`); returns the
        run's own evaluation's metrics."""
        results = self.evaluate_all(step)
        self.record_all(out, step, results)
        return results.get(MAIN, {})

    def evaluate(self, step: int, name: str = MAIN) -> Dict[str, float]:
        """The task's metrics of the state at `step` (`Task.evaluate(runner)`; `runner.step`
        is the step, for a task whose evaluation draws random numbers: D4PG seeds its
        evaluation episodes from the run's seed and the step), on the eval split, or for
        a named evaluation on its data."""
        self.step = int(step)
        self._input_fn = None if name == MAIN else self._named[name]
        try:
            return self.task.evaluate(self) or {}
        finally:
            self._input_fn = None

    def evaluate_all(self, step: int, names: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, float]]:
        """{name: metrics} of the evaluations `names` (default all), in `names()` order."""
        return {name: self.evaluate(step, name) for name in (self.names() if names is None else names)}

    def record(self, out, step: int, metrics: Dict[str, float]) -> None:
        """Records the run's own evaluation (see `record_all`)."""
        self.record_all(out, step, {MAIN: metrics})

    def record_all(self, out, step: int, results: Dict[str, Dict[str, float]]) -> None:
        """Logs a step's evaluations, each under its name (metrics.jsonl in one append,
        TensorBoard, a progress line each), and the chief writes the task's artefacts
        (`Task.write_outputs`)."""
        results = {name: metrics for name, metrics in results.items() if metrics}
        if results:
            out.log_evaluations(step, results)
        for name, metrics in results.items():
            out.progress("{} at step {}: {}".format(
                name, step, "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())))
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
        dataset = (self._input_fn or self.task.eval_input_fn)(ctx)
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
