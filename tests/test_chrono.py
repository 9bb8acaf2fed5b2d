"""Chrono counts the time of measured host calls only, and not the first (tracing)."""

import pytest

from expframe.chrono import Chrono


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_counts_measured_calls_but_not_the_first_nor_what_lies_between():
    clock = FakeClock()
    chrono = Chrono(clock)
    with chrono.measure(steps=10):  # the first call: tracing, 30 s
        clock.now += 30.0
    clock.now += 100.0  # evaluation, a checkpoint: not measured
    with chrono.measure(steps=10):
        clock.now += 2.0
    clock.now += 50.0
    with chrono.measure(steps=30):
        clock.now += 6.0
    assert chrono.lap() == pytest.approx(40 / 8.0)
    with chrono.measure(steps=5):
        clock.now += 0.5
    assert chrono.lap() == pytest.approx(10.0)  # a new interval


def test_an_interval_with_only_the_first_call_reports_it_tracing_included():
    clock = FakeClock()
    chrono = Chrono(clock)
    with chrono.measure(steps=4):
        clock.now += 8.0
    assert chrono.lap() == pytest.approx(0.5)
    with chrono.measure(steps=4):
        clock.now += 1.0
    assert chrono.lap() == pytest.approx(4.0)  # the first call no longer counts
    assert chrono.lap() == 0.0  # nothing ran
