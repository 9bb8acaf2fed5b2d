"""Studies: one command runs a sweep of gin bindings, resumes it, and writes a table and plots.

    python -m expframe.sweep --study=experiments/studies/quickstart_batch.gin

A study is a base experiment (gin files and bindings) and the bindings it varies
(`spec`): a grid product, zipped groups that move together, seeds as a swept binding.
Each run is an ordinary `main.py` run in `<root>/<run name>` (`naming`), run one at a
time or N at once, skipped when finished and resumed when not (`runner`), or handed
to Slurm as an array job (`slurm`). At the end, `summary.csv`/`summary.md` (`summary`),
`final_metrics.png`/`curves.png` (`plots`) and TensorBoard's HParams summaries
(`hparams`) are written at the study's root.

From Python:

    from expframe import sweep
    study = sweep.build_study("experiments/studies/quickstart_batch.gin")
    [run.name for run in study.runs()]
"""

from expframe.sweep.spec import Axis, Run, Study, build_study, validate

__all__ = ["Axis", "Run", "Study", "build_study", "validate"]
