"""Reproducible results: one command reruns every headline number and writes docs/results.md.

    python -m expframe.reproduce --set=quick|learning|studies|benchmarks|all

`registry` names each result once: the experiment, study or benchmark that produces
it, the numbers it reports, the threshold its slow test asserts (the slow tests read
the same entries) and a tiny variant for `--set=quick`. `running` runs a result
through the sweep runner (`expframe.sweep`; benchmarks as their scripts) and records
its numbers with their provenance (`expframe.provenance`: commit, versions, machine,
load). `page` writes results.md and its plots from the records; `baseline` evaluates
an untrained model for thresholds relative to initialisation.
"""
