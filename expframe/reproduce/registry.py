"""Every headline result: the experiment (or study, or benchmark) that produces it, the
numbers it reports, the threshold its slow test asserts, and a tiny variant for
`--set=quick`.

This is the one place these settings live. The slow learning tests read their
experiment and threshold from here (`registry.get("quickstart")`), and
`python -m expframe.reproduce` runs the same entries through the sweep runner, so a
test and the results page cannot disagree about what was run or what counts as a pass.

Adding a result is a few lines: an `Experiment(...)` in `LEARNING` (gin files,
bindings, thresholds, a tiny variant), then `registry.get(name)` in its slow test.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Callable, Optional

from expframe.reproduce import benchmark_rows, spread

# -- thresholds -------------------------------------------------------------------------------

_OPS = {">=": operator.ge, "<=": operator.le}


@dataclasses.dataclass(frozen=True)
class Threshold:
    """`metric op value`, `metric op value x (its value at initialisation)`, or
    `metric op (a baseline) + value`.

    Attributes:
      metric: a key of the run's final eval metrics (`result.json`'s "eval").
      op: ">=" or "<=".
      value: the bound, its fraction of the initial value when `of_initial`, or the
        margin over the baseline `over`.
      of_initial: compare against `value` x the metric of the untrained model.
      over: compare against `value` + this key of the baseline metrics
        (`expframe.reproduce.baseline`; e.g. "random_policy_return" of a D4PG task).
    """

    metric: str
    op: str
    value: float
    of_initial: bool = False
    over: str = ""

    def bound(self, initial: Optional[dict] = None) -> float:
        key = self.over or (self.metric if self.of_initial else "")
        if not key:
            return self.value
        if not initial or key not in initial:
            raise ValueError(f"threshold {self.text()} needs the {key} at initialisation")
        return self.value + float(initial[key]) if self.over else self.value * float(initial[key])

    def holds(self, final: dict, initial: Optional[dict] = None) -> bool:
        value = final.get(self.metric)
        return isinstance(value, (int, float)) and math.isfinite(value) and _OPS[self.op](value, self.bound(initial))

    def text(self, initial: Optional[dict] = None) -> str:
        if self.over:
            where = f" = {self.bound(initial):.4g}" if initial and self.over in initial else ""
            return f"{self.metric} {self.op} {self.over} + {self.value:g}{where}"
        if not self.of_initial:
            return f"{self.metric} {self.op} {self.value:g}"
        where = f" = {self.bound(initial):.4g}" if initial and self.metric in initial else ""
        return f"{self.metric} {self.op} {self.value:g} x its value at initialisation{where}"


# -- results --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Experiment:
    """One `main.py` run (per seed) whose final eval metrics are the result.

    Attributes:
      name: the result's name (`--only=NAME`, its directory, its slow test's lookup).
      title: one line for the page.
      gin_files: the experiment as shipped.
      gin_params: bindings on top (the slow test's, where it adds any).
      metrics: the final eval metrics the page reports, in order.
      thresholds: what the slow test asserts.
      baseline: also evaluate the untrained model (`expframe.reproduce.baseline`):
        thresholds relative to initialisation need it.
      seeds: one run per seed (`run_experiment.seed`).
      parallel: seeds run at once (`python -m expframe.sweep --parallel`).
      quick_params: bindings that shrink it to seconds for `--set=quick`.
      test: the slow test that asserts the thresholds.
      minutes: expected wall time on 2 idle cores (progress lines only): for the learning
        set, measured on the slowest 2-core machine seen (AMD EPYC without AVX-512,
        2026-12-01, docs/results.md); the machine of 2026-11-30 ran SN-GAN shapes in a fifth.
      readme: where the docs discuss it: a README section that quotes its number, or a guide.
      published: published results on the same task and budget that the page shows beside
        this one's: (who, mean, spread, source) with spread as printed, e.g. "± 92".
    """

    name: str
    title: str
    gin_files: tuple[str, ...]
    metrics: tuple[str, ...]
    thresholds: tuple[Threshold, ...] = ()
    gin_params: tuple[str, ...] = ()
    baseline: bool = False
    seeds: tuple[int, ...] = (0,)
    parallel: int = 1
    quick_params: tuple[str, ...] = ()
    test: str = ""
    minutes: float = 5.0
    readme: str = ""
    published: tuple[tuple[str, float, str, str], ...] = ()

    kind = "experiment"

    def params(self, quick: bool = False) -> tuple[str, ...]:
        """The bindings of a run (before the seed): the quick ones added for --set=quick."""
        return self.gin_params + (self.quick_params if quick else ())

    def passed(self, final: dict, initial: Optional[dict] = None) -> bool:
        return all(t.holds(final, initial) for t in self.thresholds)


@dataclasses.dataclass(frozen=True)
class StudyResult:
    """A study (`python -m expframe.sweep --study=FILE`) reported as a table and plot.

    Attributes:
      name, title, test, minutes, readme: as for `Experiment`.
      study_file: the study as shipped.
      x: the swept binding's short key the plot puts on its x axis.
      metrics: the final eval metrics reported against `x`.
      arms: arm name -> predicate on a run's values (short key -> gin text); a run
        may belong to several arms (a point they share); each arm is one line.
      quick_params, quick_sweeps, quick_zips: flags that shrink it for --set=quick
        (`--gin_param`, `--sweep`, `--zip` of `python -m expframe.sweep`).
      parallel: runs at once (`--parallel`).
      curves: (train metric, scale, label): also draw each run's eval metrics against
        that train metric x scale, interpolated at the eval steps, one line per run
        (e.g. ("env_steps", 8.0, "control steps") for a D4PG task at action repeat 8);
        () draws none.
      beside: a registered result (the experiment the study varies) whose kept runs the
        curves draw too, in grey, for comparison; "" for none.
    """

    name: str
    title: str
    study_file: str
    x: str
    metrics: tuple[str, ...]
    arms: tuple[tuple[str, Callable[[dict], bool]], ...]
    quick_params: tuple[str, ...] = ()
    quick_sweeps: tuple[str, ...] = ()
    quick_zips: tuple[str, ...] = ()
    parallel: int = 1
    test: str = ""
    minutes: float = 60.0
    readme: str = ""
    curves: tuple = ()
    beside: str = ""

    kind = "study"


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """A benchmark script under benchmarks/, run with `--out=<json>`; its ratios are the result.

    Attributes:
      name, title, minutes, readme: as for `Experiment`.
      script: path from the repository root.
      args: its arguments for the full set.
      quick_args: its arguments for --set=quick (seconds).
      rows: JSON -> the figures the page shows (`expframe.reproduce.benchmark_rows`: what,
        value, goal, spread); a figure with a goal carries its spread.
      repeated: every figure is a median over interleaved repeats and carries its spread
        (the others: bytes, or figures measured once, and any goal's figure).
    """

    name: str
    title: str
    script: str
    args: tuple[str, ...]
    quick_args: tuple[str, ...]
    rows: Callable[[dict], list[dict]]
    minutes: float = 5.0
    readme: str = ""
    repeated: bool = False

    kind = "benchmark"

    def argv(self, quick: bool = False) -> tuple[str, ...]:
        return self.quick_args if quick else self.args


# -- the learning results (the slow tests read these) -----------------------------------------

# Shrinks a shapes experiment to seconds: the small shapes build of the default tests
# (512 train / 64 test images), 2 steps; `_ONE_REPLICA` halves the tracing.
_SHAPES_TINY = ("shapes_input.num_train = 512", "shapes_input.num_test = 64", "Trainer.train_steps = 2",
                "Trainer.steps_per_loop = 1", "Trainer.log_every_steps = 1", "Trainer.eval_every_steps = None",
                "Trainer.checkpoint_every_steps = 2")
_ONE_REPLICA = ("Replicator.num_replicas = 1",)
_D4PG_TINY = ("Replicator.num_replicas = 1", "Trainer.global_batch_size = 16", "Trainer.train_steps = 2",
              "Trainer.steps_per_loop = 2", "Trainer.log_every_steps = 2", "Trainer.eval_every_steps = None",
              "Trainer.checkpoint_every_steps = 2", "d4pg_policy.layer_sizes = (16, 16)",
              "d4pg_critic.layer_sizes = (16, 16)", "control_suite.action_repeat = 8",
              "D4PGTask.min_replay_size = 50", "D4PGTask.samples_per_insert = 4.0", "D4PGTask.eval_episodes = 1")

QUICKSTART = Experiment(
    name="quickstart", title="Quickstart: ResNet-8 with sync batch norm on shapes, 2 CPU replicas",
    gin_files=("experiments/quickstart.gin",), metrics=("top1", "loss"),
    thresholds=(Threshold("top1", ">=", 0.90),),
    quick_params=_SHAPES_TINY + _ONE_REPLICA + ("resnet.depth = 8", "Trainer.global_batch_size = 16",
                                                "Trainer.eval_steps = 1"),
    test="tests/test_quickstart_slow.py", minutes=4, readme="README.md#expframe")

SNGAN_SHAPES = Experiment(
    name="sngan_shapes", title="SN-GAN on shapes (32 px, 2 CPU replicas, 5,000 generator updates)",
    gin_files=("experiments/sngan_shapes.gin",), metrics=("sample_accuracy", "fid", "inception_score"),
    thresholds=(Threshold("sample_accuracy", ">=", 0.8), Threshold("fid", "<=", 0.25, of_initial=True)),
    baseline=True,
    quick_params=_SHAPES_TINY + _ONE_REPLICA + (
        "shapes_classifier.num_train = 512", "shapes_classifier.num_test = 64", "shapes_classifier.train_steps = 10",
        "shapes_classifier.batch_size = 32", "sngan_generator.ch = 2", "sngan_generator.z_dim = 8",
        "sngan_discriminator.ch = 1", "GANTask.num_eval_samples = 16", "GANTask.inception_splits = 2",
        "GANTask.grid_columns = 3", "GANTask.ema_start_step = 0", "Trainer.global_batch_size = 8"),
    test="tests/test_sngan_experiments.py", minutes=66, readme="README.md#sn-gan-the-papers-second-benchmark")

D4PG_CONTROL = Experiment(
    name="d4pg_control", title="D4PG on cartpole/balance, acting in the learner's process (10,000 learner steps)",
    gin_files=("experiments/d4pg_control.gin",), metrics=("episode_return",),
    thresholds=(Threshold("episode_return", ">=", 800.0),), quick_params=_D4PG_TINY,
    test="tests/test_d4pg_experiments.py", minutes=6,
    readme="README.md#d4pg-on-the-control-suite-the-papers-third-benchmark")

D4PG_ACTORS = Experiment(
    name="d4pg_control_actors",
    title="D4PG on cartpole/balance with 2 actor processes over RPC (1 learner replica, 10,000 learner steps)",
    gin_files=("experiments/d4pg_control_distributed.gin",), metrics=("episode_return",),
    gin_params=("D4PGTask.num_actors = 2", "D4PGTask.actor_sigmas = (0.3, 0.3)", "Replicator.num_replicas = 1"),
    thresholds=(Threshold("episode_return", ">=", 800.0),),
    quick_params=_D4PG_TINY + ("D4PGTask.num_actors = 1", "D4PGTask.actor_sigmas = (0.3,)",
                               "D4PGTask.weights_every = 10"),
    test="tests/test_d4pg_experiments.py", minutes=5, readme="docs/d4pg.md#distributed-acting-actor-processes-over-rpc")

D4PG_PIXELS = Experiment(
    name="d4pg_control_pixels",
    title="D4PG from pixels on cartpole/swingup (64x64 frames, 1 replica, 20,000 learner steps)",
    gin_files=("experiments/d4pg_control_pixels.gin",), metrics=("episode_return",),
    # The random policy's return (and the zero action's) on the same task: the baseline,
    # measured over 10 episodes by `expframe.reproduce.baseline` (D4PGTask.baseline_metrics).
    thresholds=(Threshold("episode_return", ">=", 200.0, over="random_policy_return"),), baseline=True,
    quick_params=tuple(p for p in _D4PG_TINY if not p.startswith(("control_suite.action_repeat",
                                                                  "D4PGTask.min_replay_size"))) + (
        "control_suite.size = 16", "control_suite.frame_stack = 2", "drq_encoder.num_filters = 4",
        "drq_encoder.num_layers = 2", "drq_encoder.feature_size = 8", "D4PGTask.min_replay_size = 40",
        "D4PGTask.max_replay_size = 2000", "control_suite.action_repeat = 25"),
    test="tests/test_d4pg_pixels_experiments.py", minutes=80, readme="docs/d4pg.md#d4pg-from-pixels")

# D4PG_PIXELS's tiny variant without its replica count, for the files and studies that set their own.
_PIXELS_TINY_OWN_REPLICAS = tuple(p for p in D4PG_PIXELS.quick_params if not p.startswith("Replicator.num_replicas"))

D4PG_PIXELS_ACTORS_FILE = Experiment(
    name="d4pg_control_pixels_actors",
    title="D4PG from pixels as the paper ran it: 1 actor process feeding 2 learner replicas (cartpole/swingup, "
          "64x64 frames, 20,000 learner steps, 2 seeds)",
    gin_files=("experiments/d4pg_control_pixels_actors.gin",), metrics=("episode_return",),
    thresholds=D4PG_PIXELS.thresholds, baseline=True,
    # Both seeds side by side: each is a learner, an actor process and its render worker on
    # the same 2 cores. Measured: 50.1 min for both on an AMD EPYC (2026-12-06; main.py 47.3
    # min each); the study's arm of this file took 29-35 min a seed beside one other run.
    seeds=(0, 1), parallel=2,
    quick_params=_PIXELS_TINY_OWN_REPLICAS + ("D4PGTask.weights_every = 10",),
    test="tests/test_d4pg_pixels_experiments.py", minutes=50, readme="docs/d4pg.md#d4pg-from-pixels")

# Published pixel agents on cartpole/swingup at 100,000 control steps (mean ± std, 10 seeds).
_DRQ = "Kostrikov et al., arXiv 2004.13649 (ICLR 2021), Table 1"
_CURL = "Srinivas et al., arXiv 2004.04136 (ICML 2020), Table 1"

D4PG_PIXELS_100K = Experiment(
    name="d4pg_control_pixels_100k",
    title="D4PG from pixels on cartpole/swingup at 100,000 control steps (12,500 agent steps, 2 seeds)",
    gin_files=("experiments/d4pg_control_pixels_100k.gin",), metrics=("episode_return",),
    thresholds=(Threshold("episode_return", ">=", 200.0, over="random_policy_return"),), baseline=True,
    # Both seeds side by side: acting and learning alternate in one process, which leaves
    # part of 2 cores idle (two 20,000-step runs side by side took 66-73 min each, one alone 78).
    # Measured: 91.8 min side by side on an AMD EPYC (2026-12-04), 125.5 one after the other
    # on an Intel Xeon (2026-12-02).
    seeds=(0, 1), parallel=2, quick_params=D4PG_PIXELS.quick_params,
    test="tests/test_d4pg_pixels_experiments.py", minutes=125, readme="docs/d4pg.md#at-the-published-budget",
    published=(("DrQ [K=2,M=2]", 759.0, "± 92", _DRQ), ("CURL", 582.0, "± 146", _CURL),
               ("pixel SAC", 419.0, "± 40", _CURL), ("SAC from state (not pixels)", 835.0, "± 22", _CURL)))

VIT_MESH = Experiment(
    name="vit_shapes_mesh", title="ViT on a batch 2 x model 2 DTensor mesh of CPU devices, shapes",
    gin_files=("experiments/vit_shapes_mesh.gin",), metrics=("top1", "loss"),
    thresholds=(Threshold("top1", ">=", 0.90),),
    quick_params=_SHAPES_TINY + ("ViT.depth = 1", "ViT.width = 16", "ViT.mlp_dim = 32",
                                 "Trainer.global_batch_size = 8", "Trainer.eval_steps = 1"),
    test="tests/test_vit_mesh_experiments.py", minutes=9, readme="docs/mesh.md#model-parallelism-dtensor-mesh")

LEARNING = (QUICKSTART, SNGAN_SHAPES, D4PG_CONTROL, D4PG_ACTORS, D4PG_PIXELS, D4PG_PIXELS_ACTORS_FILE, D4PG_PIXELS_100K,
            VIT_MESH)


# -- the benchmarks (ratios measured side by side in one run) -------------------------------------

# The set's repeats (spread.REPEATS, 30): a runner ratio's bootstrap interval within +-5 %
# (the arithmetic is in expframe/reproduce/spread.py). Minutes: quiet estimates on 2 cores
# from the recorded wall times (docs/results.md, 2026-12-02) scaled to these repeats;
# docs/reproducing.md#benchmark-figures-spread-and-verdicts adds them up.
_REPEATS = str(spread.REPEATS)

BENCHMARKS = (
    Benchmark("plan_vs_measured", "The planner (python -m expframe.plan) against the real trainer: quickstart and "
              "ResNet-20 at 1-8 CPU replicas and 2-4 loopback workers", "benchmarks/plan_vs_measured.py", (),
              ("--quick",), benchmark_rows.plan_vs_measured, minutes=17,
              readme="docs/planning.md#checked-on-this-machine"),
    # 1.3 min at 7 repeats; at 30 the timing loops (under a second per repeat) add about 1.
    Benchmark("collectives", "All-reduce on CPU replicas against one copy of the same bytes",
              "benchmarks/collectives.py", ("--repeats", _REPEATS),
              ("--quick", "--allocator=bfc", "--repeats=1", "--variants=replicator"),
              benchmark_rows.collectives, minutes=3, repeated=True,
              readme="docs/programming_model.md#the-programming-model"),
    # 15.9 min at 15 repeats with 0.8 of the 2 cores taken by others (about 11 quiet): about 1 min
    # of building and 72 calls of ~8.6 s; at 30 repeats 132 calls, about 20 min.
    Benchmark("runner_overhead", "expframe's train loop against a hand-written tf.distribute loop (ResNet-20)",
              "benchmarks/runner_overhead.py", ("--repeats", _REPEATS),
              ("--replicas", "2", "--global_batch_size", "8", "--steps_per_call", "1", "--repeats", "1"),
              benchmark_rows.runner_overhead, minutes=15, repeated=True,
              readme="docs/programming_model.md#the-programming-model"),
    # The page's setting (batch 4, one step per call) at 128 and 224 px on 1 and 2 replicas, float32:
    # about 3 min to build and trace the three models of a configuration (6.5 min for the two of
    # --quick), a repeat 3.6 s at 224 px (0.9 + 0.9 s, fit's two executions 1.8) and 1.2 s at 128:
    # 4 x 3 + 30 x (2 x 3.6 + 2 x 1.2) / 60 = about 17 min estimated; 14.2 measured (2026-12-06).
    # With 'auto' (mixed_bfloat16 here) and every runner timed on the second of two calls
    # (issue 61): 30.1 and 29.4 min measured (2026-12-07, 2-core Xeon).
    Benchmark("resnet50_throughput", "ResNet-50: expframe against a hand-written loop and Keras fit, with MFU",
              "benchmarks/resnet50_throughput.py",
              ("--sizes", "224", "128", "--replicas", "2", "1", "--precisions", "float32", "auto",
               "--global_batch_size", "4", "--steps_per_call", "1", "--repeats", _REPEATS),
              ("--sizes", "32", "--replicas", "1", "--precisions", "float32", "--global_batch_size", "1",
               "--steps_per_call", "1", "--repeats", "1"),
              benchmark_rows.resnet50, minutes=30, repeated=True,
              readme="README.md#resnet-50-on-imagenet-the-papers-first-benchmark"),
    # A repeat starts 3 configurations' processes (about 3.1 min: 6.2 for 2 repeats); 6 repeats.
    Benchmark("scaling", "Weak scaling on CPU cores: 2 workers (or 2 replicas) against 1 (ResNet-20)",
              "benchmarks/scaling.py", ("--repeats", "6"),
              ("--steps_per_call", "1", "--warmup_calls", "1", "--calls", "1", "--repeats", "1", "--timeout", "900"),
              benchmark_rows.scaling, minutes=13, repeated=True, readme="docs/hardware.md#where-it-runs-one-binding"),
    Benchmark("data_checkpoint_size", "Bytes of the data position in a checkpoint (ResNet-50 ImageNet pipeline)",
              "benchmarks/data_checkpoint_size.py", (), ("--smoke",), benchmark_rows.data_checkpoint, minutes=3,
              readme="docs/running.md#running-experiments"),
    Benchmark("d4pg_throughput", "D4PG: learner updates/s on 1 and 2 replicas, env steps/s with 1 and 2 actors",
              "benchmarks/d4pg_throughput.py", (), ("--smoke",), benchmark_rows.d4pg_throughput, minutes=4,
              readme="docs/d4pg.md#distributed-acting-actor-processes-over-rpc"),
    # About 45 min on 2 shared cores: tracing 53 layers on up to 32 replicas is most of it.
    # fit_gap: 12.1 min measured; 15.5 with every variant timed on the second of two calls (issue 61).
    Benchmark("fit_gap", "Where Keras fit's lead over expframe at ResNet-50 comes from: one change at a time",
              "benchmarks/fit_gap.py", ("--size", "128", "--replicas", "2", "--repeats", _REPEATS),
              ("--size", "32", "--depth", "8", "--repeats", "1", "--variants", "expframe", "keras_fit",
               "xf_before_61"), benchmark_rows.fit_gap, minutes=16, repeated=True,
              readme="docs/resnet50.md#where-keras-fits-lead-came-from"),
    # 4 settings of 6 ResNet-50 processes, expframe's timed on the second of two calls: measured
    # 30.0 min (issue 61, 2-core Xeon; 22.9 when each call was timed).
    Benchmark("own_process", "ResNet-50 through expframe and through Keras fit, each in a process of its own: "
              "what the process set-up (threads, allocator) costs", "benchmarks/own_process.py",
              ("--sizes", "224", "128", "--replicas", "1", "2", "--repeats", _REPEATS),
              ("--sizes", "32", "--replicas", "2", "--depth", "8", "--repeats", "1"), benchmark_rows.own_process,
              minutes=30, repeated=True, readme="docs/hardware.md#logical-cpu-replicas-threads"),
    Benchmark("sync_batch_norm", "SyncBatchNorm designs on 2-32 CPU replicas: step time against plain batch norm "
              "and the variance's exactness (ResNet-50's 53 batch norms)", "benchmarks/sync_batch_norm.py",
              ("--repeats", _REPEATS), ("--quick", "--repeats=1"), benchmark_rows.sync_batch_norm, minutes=45,
              repeated=True, readme="docs/programming_model.md#syncbatchnorm"),
    Benchmark("model_parallel", "Model parallelism on a DTensor mesh: memory per device and examples/s",
              "benchmarks/model_parallel.py", (), ("--smoke",), benchmark_rows.model_parallel, minutes=3,
              readme="docs/mesh.md#model-parallelism-dtensor-mesh"),
    # Estimated, not yet timed in full: 6 s to generate and prepare 512 JPEGs, then 30 repeats of
    # ten runners (eight on 1 thread, two on 2) at 512 images each, ~13 s a repeat at the smoke
    # runs' rates (about 7 min); rounded up. --quick (32 JPEGs, 1 repeat) took 14 s.
    Benchmark("imagenet_input", "The ImageNet input pipelines (expframe/data/imagenet.py): images/s per CPU core on "
              "1 and 2 threads, against the standard ResNet recipe, and what makes the difference",
              "benchmarks/imagenet_input.py", ("--repeats", _REPEATS), ("--quick",), benchmark_rows.imagenet_input,
              minutes=10, repeated=True,
              readme="docs/planning.md#the-input-bound-a-hosts-cpu-cores-against-its-devices"),
    Benchmark("data_service_overhead", "The tf.data service's cost to the shipped ImageNet train pipeline on this "
              "machine (images/s through one shard / in-process), and distributed_epoch's order over runs",
              "benchmarks/data_service_overhead.py", ("--repeats", _REPEATS), ("--quick",),
              benchmark_rows.data_service_overhead, minutes=4, repeated=True,
              readme="docs/running.md#input-on-the-tfdata-service"),
)


# -- the studies --------------------------------------------------------------------------------

_BASE_RATE, _BASE_BATCH = 1e-3, 64  # sngan_shapes.gin's Adam rate, at its batch of 64


def _fixed_rate(values: dict) -> bool:
    return math.isclose(float(values["LR"]), _BASE_RATE, rel_tol=1e-6)


def _sqrt_scaled_rate(values: dict) -> bool:
    scaled = _BASE_RATE * math.sqrt(float(values["global_batch_size"]) / _BASE_BATCH)
    return math.isclose(float(values["LR"]), scaled, rel_tol=1e-2)  # the file writes 3 significant digits


SNGAN_BATCH = StudyResult(
    name="sngan_batch", title="SN-GAN batch-size study: FID and sample accuracy against the global batch",
    study_file="experiments/studies/sngan_batch.gin", x="global_batch_size", metrics=("fid", "sample_accuracy"),
    arms=(("fixed rate", _fixed_rate), ("rate x sqrt(batch / 64)", _sqrt_scaled_rate)),
    quick_params=tuple(p for p in SNGAN_SHAPES.quick_params if not p.startswith("Trainer.global_batch_size")),
    quick_zips=("Trainer.global_batch_size=[4, 8]", "LR=[1e-3, 1e-3]"), quick_sweeps=("run_experiment.seed=[0]",),
    # Measured on the slow 2-core AMD EPYC (AVX2) of 2026-12-01, 2 runs at once: per pair of seeds
    # about 8, 11, 19, 38 and 75 min at batch 16, 32, 64, 128, 256 (~58 examples/s per run);
    # the machine of 2026-11-30, which sized the study, ran all 18 runs in about 70 minutes.
    parallel=2, minutes=285, readme="docs/sngan.md#sn-gan-the-papers-second-benchmark")

QUICKSTART_BATCH = StudyResult(
    name="quickstart_batch", title="Quickstart batch-size study: top-1 against the global batch, rate scaled linearly",
    study_file="experiments/studies/quickstart_batch.gin", x="global_batch_size", metrics=("top1",),
    arms=(("rate 2e-3 x batch / 128, 81,920 examples", lambda values: True),),
    quick_params=("shapes_input.num_train = 512", "shapes_input.num_test = 64", "Replicator.num_replicas = 1",
                  "Trainer.eval_steps = 1", "Trainer.steps_per_loop = 1", "Trainer.log_every_steps = 1",
                  "Trainer.eval_every_steps = None", "Trainer.checkpoint_every_steps = 2"),
    quick_zips=("Trainer.global_batch_size=[16]", "keras.optimizers.Adam.learning_rate=[1e-3]",
                "Trainer.train_steps=[2]"), quick_sweeps=("run_experiment.seed=[0]",),
    parallel=2, minutes=8, readme="docs/studies.md#studies")

D4PG_PIXELS_ACTORS = StudyResult(
    name="d4pg_pixels_actors",
    title="Pixel D4PG: acting in the learner's process against 1 actor process on 1 and 2 replicas, 3 seeds",
    study_file="experiments/studies/d4pg_pixels_actors.gin", x="num_replicas", metrics=("episode_return",),
    arms=(("in the learner's process", lambda values: int(values["num_actors"]) == 0),
          ("1 actor process (weights every 20 env steps)", lambda values: int(values["num_actors"]) == 1)),
    quick_params=_PIXELS_TINY_OWN_REPLICAS,
    quick_zips=("D4PGTask.num_actors=[0]", "Replicator.num_replicas=[1]"),
    quick_sweeps=("run_experiment.seed=[0]",),
    # 9 runs, one per arm side by side (capped at the cores: 2 at a time on 2 cores). Seed 2's
    # three took 64.5 min that way on an AMD EPYC (2026-12-05: 54.8 min in-process beside
    # 34.4 and then 29.1 with an actor process); seeds 0 and 1 (hand-started sittings, 25-73
    # min each) are kept beside the page. From nothing: about 3 sittings of that.
    parallel=3, minutes=200, readme="docs/d4pg.md#actor-processes-against-in-process-acting-study",
    curves=("env_steps", 8.0, "control steps (agent steps x action repeat 8)"))

D4PG_PIXELS_100K_BATCH = StudyResult(
    name="d4pg_pixels_100k_batch",
    title="Pixel D4PG at 100,000 control steps at batch 128 (the shipped file: 64), one update per agent step, 2 seeds",
    study_file="experiments/studies/d4pg_pixels_100k_batch.gin", x="global_batch_size", metrics=("episode_return",),
    arms=(("one update per agent step (samples per insert = batch)", lambda values: True),),
    quick_params=tuple(p for p in D4PG_PIXELS.quick_params if not p.startswith(("Trainer.global_batch_size",
                                                                                "D4PGTask.samples_per_insert"))),
    quick_zips=("Trainer.global_batch_size=[8]", "D4PGTask.samples_per_insert=[8.0]"),
    quick_sweeps=("run_experiment.seed=[0]",),
    # 2 runs, one at a time: 83.3 and 85.0 min alone on an AMD EPYC (2026-12-05); the
    # batch-64 pair is the 100k result (91.8 min side by side).
    parallel=1, minutes=170, readme="docs/d4pg.md#at-the-published-budget",
    curves=("env_steps", 8.0, "control steps (agent steps x action repeat 8)"), beside="d4pg_control_pixels_100k")

STUDIES = (SNGAN_BATCH, QUICKSTART_BATCH, D4PG_PIXELS_ACTORS, D4PG_PIXELS_100K_BATCH)

# -- the sets ---------------------------------------------------------------------------------------

SETS = {"learning": LEARNING, "studies": STUDIES, "benchmarks": BENCHMARKS}
ALL = LEARNING + STUDIES + BENCHMARKS


def results(set_name: str) -> tuple:
    """The results of a set: learning, studies, benchmarks, or all (and quick: all, tiny)."""
    return ALL if set_name in ("all", "quick") else SETS[set_name]


def set_of(result) -> str:
    return next(name for name, members in SETS.items() if result in members)


def get(name: str):
    """The registered result called `name` (KeyError naming the known ones otherwise)."""
    for result in ALL:
        if result.name == name:
            return result
    raise KeyError(f"no result {name!r}; known: {', '.join(r.name for r in ALL)}")
