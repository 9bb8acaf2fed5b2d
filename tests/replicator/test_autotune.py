"""'auto' by measurement: the choice, the cache, a corrupt cache, re-measuring
(expframe/replicator/autotune.py, auto_settings.py, probes.py).

Timings come from fake timers, so the outcomes do not depend on this machine; the
real probes run once at tiny sizes. Every cache lives in a temporary directory.
"""

import json
import os
import threading

import pytest
import tensorflow as tf

import expframe as xf
from expframe import experiment
from expframe.replicator import auto_settings, autotune, probes

CPU = ("float32", "mixed_bfloat16")


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """A quiet machine, whatever this one's load: measurements are cached (a busy one: below)."""
    monkeypatch.setattr(autotune, "_load_average", lambda: 0.0)


def fake_timer(seconds, calls=None):
    """make_timer for autotune: each candidate takes `seconds[candidate]`; counts calls."""
    def make():
        def timer(candidate):
            if calls is not None:
                calls.append(candidate)
            value = seconds[candidate]
            if isinstance(value, Exception):
                raise value
            return value
        return timer
    return make


def never_measure():
    raise AssertionError("measured although the choice is cached")


def choose(tmp_path, seconds, key="precision|CPU test|TF x", candidates=CPU, lines=None, **kwargs):
    return autotune.choose("run_experiment.precision", key, candidates, fake_timer(seconds), "CPU test",
                           directory=str(tmp_path), log=(lines if lines is not None else []).append, **kwargs)


def cache(tmp_path):
    with open(tmp_path / autotune.CACHE_FILE, encoding="utf-8") as f:
        return json.load(f)


def test_bfloat16_faster_is_chosen_and_logged_with_its_ratio(tmp_path):
    lines = []
    choice = choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 0.5}, lines=lines)
    assert choice.value == "mixed_bfloat16" and choice.measured_now
    assert len(lines) == 1
    assert "run_experiment.precision='auto' -> mixed_bfloat16" in lines[0]
    assert "mixed_bfloat16 2.00x the speed of float32" in lines[0]
    assert str(tmp_path / autotune.CACHE_FILE) in lines[0] and "EXPFRAME_REMEASURE=1" in lines[0]
    entry = cache(tmp_path)["precision|CPU test|TF x"]
    assert entry["choice"] == "mixed_bfloat16" and entry["seconds"] == {"float32": 1.0, "mixed_bfloat16": 0.5}


def test_bfloat16_slower_keeps_float32(tmp_path):
    lines = []
    assert choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 1.35}, lines=lines).value == "float32"
    assert "-> float32" in lines[0] and "mixed_bfloat16 0.74x the speed of float32" in lines[0]


def test_a_gain_within_noise_keeps_the_baseline(tmp_path):
    # 3% faster: under MIN_SPEEDUP (5%), so noise cannot flip the choice.
    assert choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 0.97}).value == "float32"


def test_gpu_candidates_fastest_wins_and_a_failing_candidate_is_left_out(tmp_path):
    gpu = ("float32", "mixed_bfloat16", "mixed_float16")
    seconds = {"float32": 1.0, "mixed_bfloat16": 0.5, "mixed_float16": 0.3}
    assert choose(tmp_path, seconds, key="a", candidates=gpu).value == "mixed_float16"
    lines = []
    seconds["mixed_float16"] = tf.errors.UnimplementedError(None, None, "no float16 conv here")
    assert choose(tmp_path, seconds, key="b", candidates=gpu, lines=lines).value == "mixed_bfloat16"
    assert "mixed_float16 failed to run" in lines[0]


def test_each_candidate_counts_its_fastest_of_interleaved_repeats(tmp_path):
    calls = []
    times = {"float32": iter([3.0, 1.0, 3.0]), "mixed_bfloat16": iter([1.5, 1.5, 1.5])}
    seconds = autotune.measure(CPU, lambda c: (calls.append(c), next(times[c]))[1], repeats=3)
    assert seconds == {"float32": 1.0, "mixed_bfloat16": 1.5}
    assert calls == ["float32", "mixed_bfloat16", "mixed_bfloat16", "float32", "float32", "mixed_bfloat16"]


def test_cached_choice_is_reused_without_measuring(tmp_path):
    choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 0.5})
    lines = []
    again = autotune.choose("run_experiment.precision", "precision|CPU test|TF x", CPU, never_measure, "CPU test",
                            directory=str(tmp_path), log=lines.append)
    assert again.value == "mixed_bfloat16" and not again.measured_now
    assert "mixed_bfloat16 2.00x the speed of float32 (measured 20" in lines[0]
    # Another device model or TensorFlow version is another key: measured afresh.
    assert choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 2.0}, key="precision|CPU other|TF x").value == "float32"
    assert set(cache(tmp_path)) == {"precision|CPU test|TF x", "precision|CPU other|TF x"}


def test_remeasure_env_var_measures_again_and_rewrites(tmp_path, monkeypatch):
    choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 0.5})
    monkeypatch.setenv(autotune.REMEASURE_ENV, "1")
    calls = []
    choice = autotune.choose("q", "precision|CPU test|TF x", CPU, fake_timer({"float32": 1.0, "mixed_bfloat16": 2.0},
                                                                            calls), "CPU test",
                             directory=str(tmp_path), log=[].append)
    assert calls and choice.value == "float32" and choice.measured_now
    assert cache(tmp_path)["precision|CPU test|TF x"]["choice"] == "float32"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "", "\x00\xff"])
def test_corrupt_cache_is_measured_again_and_rewritten(tmp_path, content):
    (tmp_path / autotune.CACHE_FILE).write_text(content, encoding="utf-8", errors="surrogateescape")
    lines = []
    choice = choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 0.5}, lines=lines)
    assert choice.value == "mixed_bfloat16" and choice.measured_now
    assert "cannot be read" in lines[0] and "measuring again" in lines[0] and len(lines) == 2
    assert cache(tmp_path)["precision|CPU test|TF x"]["choice"] == "mixed_bfloat16"


@pytest.mark.parametrize("entry", [
    {"choice": "float8", "seconds": {}}, {"choice": "float32"}, "float32",
    {"choice": "float32", "seconds": {"float32": -1}},
    # Issue 30: these two crashed the run (KeyError in the log line; a format error).
    {"choice": "mixed_bfloat16", "seconds": {"mixed_bfloat16": 0.5}},
    {"choice": "float32", "seconds": {"float32": 1.0, "mixed_bfloat16": 0.5}, "load_average": "0.5"},
    {"choice": "float32", "seconds": {"float32": True}},
    {"choice": "float32", "seconds": {"float32": 1.0, "float8": 0.1}}])
def test_damaged_entry_is_measured_again(tmp_path, entry):
    (tmp_path / autotune.CACHE_FILE).write_text(json.dumps({"precision|CPU test|TF x": entry, "other": 1}))
    lines = []
    assert choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 0.5}, lines=lines).value == "mixed_bfloat16"
    assert "damaged entry" in lines[0]
    assert cache(tmp_path)["other"] == 1  # the rest of the cache is kept


def test_a_measurement_on_a_busy_machine_is_used_once_and_not_cached(tmp_path):
    """Under load a ratio can flip (bfloat16 1.19x 'faster' at load 16 on 2 cores while
    its matmuls and convolutions were slower): the choice holds for this run only."""
    lines = []
    busy = autotune._cores() + 1.0  # pylint: disable=protected-access
    choice = choose(tmp_path, {"float32": 1.0, "mixed_bfloat16": 0.5}, lines=lines, load_average=lambda: busy)
    assert choice.value == "mixed_bfloat16" and choice.measured_now
    # One honest line: not "not cached" and then "cached in ..." (issue 30).
    assert len(lines) == 1 and "-> mixed_bfloat16" in lines[0], lines
    assert "busy" in lines[0] and "not cached" in lines[0] and "next run measures again" in lines[0], lines
    assert "cached in" not in lines[0] and not choice.cached
    assert not (tmp_path / autotune.CACHE_FILE).exists()
    # Quiet again: measured afresh and cached.
    calls = []
    again = autotune.choose("run_experiment.precision", "precision|CPU test|TF x", CPU,
                            fake_timer({"float32": 1.0, "mixed_bfloat16": 2.0}, calls), "CPU test",
                            directory=str(tmp_path), log=[].append)
    assert calls and again.value == "float32"
    assert cache(tmp_path)["precision|CPU test|TF x"]["choice"] == "float32"


def test_unwritable_cache_still_gives_the_measured_choice(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    lines = []
    choice = autotune.choose("q", "k", CPU, fake_timer({"float32": 1.0, "mixed_bfloat16": 0.5}), "CPU test",
                             directory=str(blocker / "expframe"), log=lines.append)
    assert choice.value == "mixed_bfloat16" and not choice.cached
    assert "-> mixed_bfloat16" in lines[-1] and "not cached: could not write" in lines[-1], lines
    assert "this run only" in lines[-1] and not any("cached in" in line for line in lines), lines


def test_cache_directory_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(autotune.CACHE_ENV, str(tmp_path / "explicit"))
    assert autotune.cache_dir() == str(tmp_path / "explicit")
    monkeypatch.delenv(autotune.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert autotune.cache_dir() == str(tmp_path / "xdg" / "expframe")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert autotune.cache_dir() == str(tmp_path / "home" / ".cache" / "expframe")


def test_the_tests_never_use_the_home_cache():
    assert os.environ[autotune.CACHE_ENV] != os.path.join(os.path.expanduser("~"), ".cache", "expframe")
    assert autotune.cache_dir() == os.environ[autotune.CACHE_ENV]


def test_replicator_fastest_precision_measures_on_its_device(tmp_path):
    rep = xf.Replicator("cpu", 2)
    calls = []
    fast = rep.fastest_precision(fake_timer({"float32": 2.0, "mixed_bfloat16": 1.0}, calls), str(tmp_path))
    assert fast == "mixed_bfloat16" and set(calls) == set(CPU)  # float16 is never a CPU candidate
    key, = cache(tmp_path)
    assert key == f"run_experiment.precision|{probes.hardware_id('/device:CPU:0')}|TensorFlow {tf.__version__}"
    assert key.startswith(f"run_experiment.precision|{probes.device_model('/device:CPU:0')} [")


def test_run_experiment_auto_uses_the_cached_measurement():
    # What run_experiment.precision = 'auto' resolves to is the cached measurement (the
    # session's cache, seeded here), not a CPU flag.
    rep = xf.Replicator("cpu", 1)
    key = auto_settings.cache_key("run_experiment.precision", "/device:CPU:0")
    path = os.path.join(autotune.cache_dir(), autotune.CACHE_FILE)
    entries = json.load(open(path, encoding="utf-8")) if os.path.exists(path) else {}
    previous = entries.get(key)
    try:
        for choice, seconds in (("mixed_bfloat16", 0.5), ("float32", 2.0)):
            entries[key] = {"choice": choice, "seconds": {"float32": 1.0, "mixed_bfloat16": seconds}}
            with open(path, "w", encoding="utf-8") as f:
                json.dump(entries, f)
            assert experiment._precision_for("auto", rep) == choice  # pylint: disable=protected-access
    finally:
        if previous is None:
            entries.pop(key)
        else:
            entries[key] = previous
        with open(path, "w", encoding="utf-8") as f:
            json.dump(entries, f)


def test_the_key_names_the_cpu_flags_that_decide(tmp_path, monkeypatch):
    """An AVX2-only EPYC and one with avx512_bf16 share a model name prefix but not a
    key (issue 30: both were "CPU AMD EPYC"); flags that do not decide are not in it."""
    avx2 = {"sse2", "avx", "avx2", "fma", "f16c"}
    bf16 = avx2 | {"avx512f", "avx512bw", "avx512_bf16"}
    cpu = "/device:CPU:0"
    keys = {auto_settings.cache_key("run_experiment.precision", cpu, cpu_flags=f) for f in (avx2, bf16)}
    assert len(keys) == 2
    model = probes.device_model(cpu)
    assert probes.hardware_id(cpu, avx2) == f"{model} [avx avx2 f16c fma]"
    assert probes.hardware_id(cpu, bf16) == f"{model} [avx avx2 avx512_bf16 avx512bw avx512f f16c fma]"
    assert probes.hardware_id(cpu, avx2 | {"sse4_2", "aes"}) == probes.hardware_id(cpu, avx2)
    assert probes.hardware_id(cpu, set()) == f"{model} [no vector flags]"
    assert auto_settings.cache_key("Replicator.jit_compile", cpu, "mixed_bfloat16", cpu_flags=avx2).endswith(
        f"[avx avx2 f16c fma]|TensorFlow {tf.__version__}|mixed_bfloat16")
    # One machine's cached choice is not another's: the second CPU measures afresh.
    calls = []
    for flags, seconds in ((avx2, 1.0), (bf16, 0.5)):
        monkeypatch.setattr(probes.provenance, "cpu_flags", lambda flags=flags: set(flags))
        choice = auto_settings.precision_choice("cpu", make_timer=fake_timer(
            {"float32": 1.0, "mixed_bfloat16": seconds}, calls), directory=str(tmp_path), log=[].append)
        assert choice.measured_now
    assert choice.value == "mixed_bfloat16" and len(calls) == 2 * autotune.REPEATS * 2
    assert {e["choice"] for e in cache(tmp_path).values()} == {"float32", "mixed_bfloat16"}


def test_two_processes_storing_at_once_keep_both_entries(tmp_path):
    """Both read the cache before either writes (a barrier in the probe); each write
    re-reads the file under the lock, so neither entry is lost (issue 30: one was)."""
    barrier = threading.Barrier(2, timeout=30)
    results, errors = {}, []

    def run(key, seconds):
        def make():
            def timer(candidate):
                if not results.get(key + "waited"):
                    results[key + "waited"] = True
                    barrier.wait()
                return seconds[candidate]
            return timer
        try:
            results[key] = autotune.choose("run_experiment.precision", key, CPU, make, "CPU test",
                                           directory=str(tmp_path), log=[].append, repeats=1)
        except Exception as e:  # pylint: disable=broad-except
            errors.append(e)

    threads = [threading.Thread(target=run, args=("a", {"float32": 1.0, "mixed_bfloat16": 0.5})),
               threading.Thread(target=run, args=("b", {"float32": 1.0, "mixed_bfloat16": 2.0}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert {k: e["choice"] for k, e in cache(tmp_path).items()} == {"a": "mixed_bfloat16", "b": "float32"}
    assert os.path.exists(str(tmp_path / autotune.CACHE_FILE) + autotune.LOCK_SUFFIX)


def test_the_precision_a_cluster_agreed_on_is_logged():
    lines = []
    agreed = auto_settings.agreed_precision("mixed_bfloat16", 2, lambda value, op: min(value, 0.0), lines.append)
    assert agreed == "float32"
    assert lines == ["expframe: run_experiment.precision='auto' -> float32 on all 2 workers (the first in order "
                     "float32, mixed_bfloat16, mixed_float16 of their measured choices; this worker measured "
                     "mixed_bfloat16)"]


def test_tpu_is_bfloat16_without_measuring():
    assert auto_settings.auto_precision("tpu", make_timer=never_measure) == "mixed_bfloat16"


def test_real_probes_run_on_this_cpu():
    timer = probes.precision_timer("/device:CPU:0", tiny=True)
    assert all(timer(policy) > 0 for policy in ("float32", "mixed_bfloat16", "mixed_float16"))
    xla = probes.xla_timer("/device:CPU:0", tiny=True)
    assert xla("off") > 0 and xla("on") > 0
    assert probes.device_model("/device:CPU:0").startswith("CPU ")
