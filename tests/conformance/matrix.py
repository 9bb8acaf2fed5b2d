"""The conformance matrix (issue 18): same science on every path.

Every shipped task family, at every precision, on every target a CPU can run, either
takes the first updates of its float32 run on one replica, or is refused before
anything is traced or written, with one line that names the binding to change.

A combination is the family's shipped gin file shrunk by bindings (tiny networks,
batch 4, 3 updates), run exactly as main.py runs it: `config.parse` then
`run_experiment` (many single-process combinations share one process:
`python -m tests.conformance.matrix --run_group=N ...`), or `python -m
expframe.launch ... -- main.py ...` for the cluster targets. The only addition is an
observer that checkpoints the initial parameters (step 0) before training.

What is compared: the trainable parameters of the family's networks, read from the
checkpoints at step 0 and step 3 (batch-norm statistics and spectral-norm vectors are
state, not parameters, and are left out). A combination's update is its parameters
at step 3 minus the reference's at step 0 (every run starts from the same seeded
initialisation; in-process runs check it). float32 must match the reference's
parameters to FLOAT32_ATOL on any target; mixed precision must give an update whose
cosine similarity with the reference's is above MIXED_MIN_COSINE and whose norm is
within MIXED_NORM_TOLERANCE of it.

Regenerate docs/conformance_matrix.md (the test checks its combinations, results
and thresholds; the numbers depend on the CPU):

    python -m tests.conformance.matrix --write_docs
"""

import argparse
import dataclasses
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from tests import main_runner as mr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "conformance_matrix.md")
REGENERATE = "python -m tests.conformance.matrix --write_docs"

FLOAT32_ATOL = 1e-5            # max |parameter difference| after 3 updates, float32 on any target
# Cosine similarity of the parameter update, mixed precision. Adam's first updates
# are about +-lr for every parameter whose gradient is clear of 0, so they flip
# where rounding moves a gradient across 0: bfloat16 keeps 8 bits of mantissa
# (float16: 11): measured ~0.97 (bfloat16) and ~0.993 (float16) on the GAN.
MIXED_MIN_COSINE = {"mixed_float16": 0.98, "mixed_bfloat16": 0.95}
MIXED_NORM_TOLERANCE = 0.10    # |norm ratio of the parameter update - 1|, mixed precision
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
STEPS = 3

# Names of the non-trainable variables of the shipped networks, as they appear in
# checkpoint keys (batch-norm statistics, spectral-norm power-iteration vectors).
_STATE = ("moving_mean", "moving_variance", "sn_u")
# Children of a network that are not its parameters: a compiled Keras model's optimizer.
_NOT_PARAMETERS = ("optimizer",)

_TINY = ("Trainer.global_batch_size = 4", f"Trainer.train_steps = {STEPS}", f"Trainer.steps_per_loop = {STEPS}",
         f"Trainer.log_every_steps = {STEPS}", f"Trainer.checkpoint_every_steps = {STEPS}",
         "Trainer.eval_every_steps = None", "run_experiment.deterministic = True")
_SHAPES = ("shapes_input.num_train = 512", "shapes_input.num_test = 64")


@dataclasses.dataclass(frozen=True)
class Family:
    """A shipped task family: its gin file, the bindings that shrink it, its networks."""

    name: str
    gin_file: str
    shrink: Tuple[str, ...]
    networks: Tuple[str, ...]  # Task.trackables() keys whose trainable variables are compared
    reference_target: str = "cpu x1"
    float16: Tuple[str, ...] = ()  # bindings added under mixed_float16
    note: str = ""


FAMILIES = {f.name: f for f in (
    Family("classification", "experiments/quickstart.gin", _TINY + _SHAPES + ("resnet.depth = 8",), ("model",)),
    Family("sngan", "experiments/sngan_shapes.gin",
           _TINY + _SHAPES + ("sngan_generator.ch = 2", "sngan_generator.z_dim = 8", "sngan_discriminator.ch = 4",
                              "GANTask.feature_network = None", "GANTask.ema_decay = None"),
           ("generator", "discriminator"), float16=("wrap_optimizer.loss_scale = 1024.0",),
           note="sngan under mixed_float16 runs with a fixed `wrap_optimizer.loss_scale = 1024.0`: with the "
           "default dynamic scale (2^15 at the start) its first 4 discriminator and 3 generator updates overflow "
           "float16 and are skipped while the scale halves to 2^10 and 2^11 (as dynamic loss scaling does in Keras "
           "and PyTorch), so the first updates cannot be compared; 1024 is where the dynamic scale settles. The "
           "moving average of the generator (`GANTask.ema_decay`) is off: it is not a trained parameter."),
    Family("d4pg", "experiments/d4pg_control.gin",
           _TINY + ("d4pg_policy.layer_sizes = (16, 16)", "d4pg_critic.layer_sizes = (16, 16)",
                    "d4pg_critic.num_atoms = 11", "D4PGTask.min_replay_size = 16", "D4PGTask.samples_per_insert = 4.0",
                    "D4PGTask.max_replay_size = 1000"), ("policy", "critic")),
    Family("d4pg_pixels", "experiments/d4pg_control_pixels.gin",
           _TINY + ("control_suite.size = 16", "control_suite.frame_stack = 2", "drq_encoder.num_filters = 4",
                    "drq_encoder.num_layers = 2", "drq_encoder.feature_size = 8", "d4pg_policy.layer_sizes = (16,)",
                    "d4pg_critic.layer_sizes = (16,)", "d4pg_critic.num_atoms = 11", "D4PGTask.min_replay_size = 16",
                    "D4PGTask.samples_per_insert = 4.0", "D4PGTask.max_replay_size = 1000",
                    "D4PGTask.eval_episodes = 1", "D4PGTask.preactivation_penalty = 0.01",
                    "D4PGTask.initial_sigma = 1.0", "D4PGTask.sigma_decay_steps = 10"),
           ("policy", "critic", "observation_network"),
           note="d4pg_pixels is experiments/d4pg_control_pixels.gin at 16x16 frames, 2 stacked, with a 2-layer "
           "encoder of 4 filters, with the study's exploration (HER's pre-activation penalty, DrQ-v2's "
           "decaying sigma): the rendered frames, the frame replay with its random shifts and the shared "
           "encoder (trained by the critic's optimizer) take the same first updates on every CPU target and "
           "precision."),
    Family("keras", "experiments/keras_shapes.gin", _TINY + _SHAPES + ("resnet.depth = 8",), ("model",),
           note="keras is experiments/keras_shapes.gin: the classification family's ResNet-8, built and compiled "
           "as a Keras model and trained by KerasModelTask with its compile loss, metrics and optimizer; it runs "
           "on `multi_worker` and `parameter_server`, where Keras' own `fit` fails, and its float32 reference "
           "takes the classification reference's updates (test_matrix.py)."),
    Family("vit_mesh", "experiments/vit_shapes_mesh.gin",
           _TINY + _SHAPES + ("ViT.width = 8", "ViT.num_heads = 2", "ViT.mlp_dim = 8", "ViT.depth = 1",
                              "ViT.stem_widths = (4, 4, 8)"), ("model",), reference_target="mesh 1x1"),
)}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a combination runs: bindings, and for cluster targets the launcher's flags."""

    name: str
    bindings: Tuple[str, ...]
    launch: Tuple[str, ...] = ()  # python -m expframe.launch flags; empty: one process
    note: str = ""


TARGETS = {t.name: t for t in (
    Target("cpu x1", ("Replicator.target = 'cpu'", "Replicator.num_replicas = 1", "Replicator.mesh_shape = None")),
    Target("cpu x2", ("Replicator.target = 'cpu'", "Replicator.num_replicas = 2", "Replicator.mesh_shape = None")),
    Target("multi_worker x2", ("Replicator.target = 'multi_worker'", "Replicator.num_replicas = None"),
           ("--workers=2",), "2 processes through python -m expframe.launch, one replica each"),
    # Asynchronous: with several workers the order of updates is not defined, so the
    # comparison uses one worker (its steps run in order on the parameter servers).
    Target("parameter_server x1", ("Replicator.target = 'parameter_server'", "Replicator.num_replicas = None",
                                   "resnet.norm = @BatchNormalization"),
           ("--workers=1", "--ps=1"), "1 worker + 1 parameter server through python -m expframe.launch; "
           "asynchronous training is compared with one worker, whose updates are applied in order"),
    Target("mesh 1x1", ("Replicator.target = 'mesh'", "Replicator.mesh_shape = {'batch': 1, 'model': 1}")),
    Target("mesh 2x2", ("Replicator.target = 'mesh'", "Replicator.mesh_shape = {'batch': 2, 'model': 2}")),
)}


@dataclasses.dataclass(frozen=True)
class Combination:
    """One cell: what it must give ('match', or 'refused' with a line matching `refusal`)."""

    family: str
    target: str
    precision: str
    refusal: str = ""  # regex of the one-line refusal (names the binding to change); empty: must match
    slow: bool = False  # only in the slow test (-m slow) and the regenerated table: its cost, not its result
    # Run as a user's command, `python main.py ...` in a process of its own, not in a group's
    # process: a refusal's exit status, its output and the model_dir are then the process's.
    via_main: bool = False

    @property
    def key(self) -> str:
        return f"{self.family} | {self.target} | {self.precision}"

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", self.key.lower()).strip("_")

    @property
    def is_reference(self) -> bool:
        """Whether this is the run its family's others are compared with."""
        return self.key == reference(self.family).key

    @property
    def suite(self) -> str:
        return "slow" if self.slow else "default"

    def bindings(self) -> List[str]:
        family = FAMILIES[self.family]
        return (list(family.shrink) + list(TARGETS[self.target].bindings)
                + [f"run_experiment.precision = '{self.precision}'"]
                + list(family.float16 if self.precision == "mixed_float16" else ()))


_MESH_PRECISION = r"^run_experiment.precision='mixed_\w+' is not available on Replicator.target='mesh'"
# Through main.py, a refusal that names a binding first says where it was bound.
_WHERE = r'(?:--gin_param="[^"]*": |\S+:\d+: )?'
_PS_FLOAT16 = ("^" + _WHERE + r"run_experiment.precision='mixed_float16' \(it turns on dynamic loss scaling\) needs "
               r"synchronous replicas.*use run_experiment.precision='mixed_bfloat16'")


def combinations(slow: bool = True) -> List[Combination]:
    """Every cell of the matrix in table order (without `slow`: those of the default tests).

    Slow, for the default suite's time limit: mixed precision on the cluster targets
    (multi_worker: its float32 stays in the default tests, its mixed precision is that of
    the same model on `cpu x2`; parameter_server: its float32 and its refusal of float16
    stay), the refusals of D4PG and the SN-GAN on parameter servers (the same checks
    as D4PG on multi_worker and the ResNet's SyncBatchNorm in tests/test_multi_worker.py),
    and the compiled Keras model's mixed precision on 2 replicas and on the cluster
    targets (its float32 on every target and its mixed precision on 1 replica stay).
    Every other family at every precision on 1 and 2 replicas is in the default tests.
    """
    out = []
    for family in ("classification", "sngan", "d4pg", "d4pg_pixels", "keras"):
        for target in ("cpu x1", "cpu x2"):
            # The compiled Keras model is the classification family's ResNet: its mixed
            # precision on 2 replicas adds nothing that 1 replica and float32 do not check.
            out += [Combination(family, target, p, slow=family == "keras" and target == "cpu x2" and p != "float32")
                    for p in PRECISIONS]
    out += [Combination("classification", "multi_worker x2", p, slow=p != "float32") for p in PRECISIONS]
    out += [Combination("classification", "parameter_server x1", p, _PS_FLOAT16 if p == "mixed_float16" else "",
                        slow=p == "mixed_bfloat16") for p in PRECISIONS]
    # The compiled Keras model: its float32 on both cluster targets in the default tests (the
    # 2 loopback workers of issue 51), the rest as the classification family's slow cells.
    out += [Combination("keras", "multi_worker x2", p, slow=p != "float32") for p in PRECISIONS]
    out += [Combination("keras", "parameter_server x1", p, _PS_FLOAT16 if p == "mixed_float16" else "",
                        slow=p != "float32") for p in PRECISIONS]
    # Refused on targets they cannot use (the checks come before the precision matters).
    out.append(Combination("d4pg", "multi_worker x2", "float32",
                           r"^D4PGTask acts in the learner's process .*Replicator.target='multi_worker' runs several"))
    out.append(Combination("d4pg", "parameter_server x1", "float32", r"^D4PGTask acts in the learner's process "
                           r".*Replicator.target='parameter_server' runs several", slow=True))
    out += [Combination("d4pg", target, "float32", r"^D4PGTask's train step sends its TD errors to the host "
                        r".*Replicator.target='mesh'.*use Replicator.target='cpu'")
            for target in ("mesh 1x1", "mesh 2x2")]
    out.append(Combination("sngan", "parameter_server x1", "float32",
                           r"^SyncBatchNorm cannot synchronise under Replicator.target='parameter_server'", slow=True))
    for target in ("mesh 1x1", "mesh 2x2"):
        out += [Combination("vit_mesh", target, p, _MESH_PRECISION if p != "float32" else "") for p in PRECISIONS]
    out.append(Combination("vit_mesh", "cpu x1", "float32",
                           r"^MeshClassificationTask needs Replicator.target='mesh'.*set Replicator.target",
                           via_main=True))
    return [c for c in out if slow or not c.slow]


def reference(family: str) -> Combination:
    return Combination(family, FAMILIES[family].reference_target, "float32")


# In-process groups (one process each, run side by side with the cluster launches);
# the SN-GAN (with the pixel D4PG beside it) costs about as much as the three others together.
GROUPS = ({"sngan", "d4pg_pixels"}, {"classification", "d4pg", "vit_mesh", "keras"})


def _in_group(combo: Combination, group: int) -> bool:
    return not TARGETS[combo.target].launch and not combo.via_main and combo.family in GROUPS[group]


# -- parameters ------------------------------------------------------------------------


def parameters(checkpoint: str, networks: Sequence[str]) -> Dict[str, np.ndarray]:
    """The trainable variables of `networks` in a checkpoint, by their path from the task's
    trackables (e.g. `generator/_operations/6/conv1/kernel`).

    A variable reachable by several paths is saved once, under the shortest (a GAN's
    kernels under its optimizer's variable list), so the checkpoint's object graph
    says where each path's value is.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tensorflow.core.protobuf import trackable_object_graph_pb2  # pylint: disable=import-outside-toplevel
    reader = tf.train.load_checkpoint(checkpoint)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    out, seen = {}, set()
    stack = [(child.node_id, [child.local_name]) for child in reversed(graph.nodes[0].children)
             if child.local_name in networks]
    while stack:
        node_id, path = stack.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        node = graph.nodes[node_id]
        for attribute in node.attributes:
            if attribute.name == "VARIABLE_VALUE" and path[-1] not in _STATE:
                out["/".join(path)] = reader.get_tensor(attribute.checkpoint_key).astype(np.float64)
        stack.extend((child.node_id, path + [child.local_name]) for child in reversed(node.children)
                     if child.local_name not in _NOT_PARAMETERS)
    return out


def agreement(run: Dict[str, np.ndarray], ref_start: Dict[str, np.ndarray],
              ref_end: Dict[str, np.ndarray]) -> Dict[str, float]:
    """max |run - ref| at the end; cosine and norm ratio of the updates (end - ref start)."""
    if sorted(run) != sorted(ref_end):
        raise AssertionError(f"different parameters: {sorted(set(run) ^ set(ref_end))[:4]}")
    keys = sorted(ref_end)
    update = np.concatenate([(run[k] - ref_start[k]).ravel() for k in keys])
    ref_update = np.concatenate([(ref_end[k] - ref_start[k]).ravel() for k in keys])
    norm, ref_norm = np.linalg.norm(update), np.linalg.norm(ref_update)
    return {"max_abs_diff": float(max(np.abs(run[k] - ref_end[k]).max() for k in keys)),
            "cosine": float(update @ ref_update / (norm * ref_norm)), "norm_ratio": float(norm / ref_norm),
            "update_norm": float(ref_norm)}


def passes(combo: Combination, result: dict) -> Tuple[bool, str]:
    """Whether a result is what the combination must give, and why not."""
    if combo.refusal:
        if result["result"] != "refused":
            return False, f"should be refused, got {result['result']}: {result.get('error', '')}"
        line = result["error"]
        ok = bool(re.search(combo.refusal, line)) and result.get("exit_code") == 2 and not result.get("wrote")
        if combo.via_main:  # main.py's whole output is the one line
            ok = ok and result.get("via") == "main.py" and result.get("output_lines") == 1
        return ok, (f"refusal {line!r} (exit {result.get('exit_code')}, wrote {result.get('wrote')}"
                    + (f", {result.get('output_lines')} line(s) of output from {result.get('via')}"
                       if combo.via_main else "") + ")")
    if result["result"] != "ran":
        return False, f"did not run: {result.get('error', '')}"
    a = result["agreement"]
    if combo.precision == "float32":
        return a["max_abs_diff"] <= FLOAT32_ATOL, f"max |diff| {a['max_abs_diff']:.3g} > {FLOAT32_ATOL:g}"
    ok = a["cosine"] > MIXED_MIN_COSINE[combo.precision] and abs(a["norm_ratio"] - 1) <= MIXED_NORM_TOLERANCE
    return ok, f"cosine {a['cosine']:.5f}, norm ratio {a['norm_ratio']:.4f}"


# -- running ---------------------------------------------------------------------------


def _run_in_process(combo: Combination, work_dir: str) -> dict:
    """One combination as main.py runs it (config.parse, run_experiment), in this process."""
    import gin  # pylint: disable=import-outside-toplevel

    from expframe import config, errors, experiment  # pylint: disable=import-outside-toplevel
    from expframe.trainer import Trainer  # pylint: disable=import-outside-toplevel

    family = FAMILIES[combo.family]
    model_dir = os.path.join(work_dir, combo.slug)
    seen = {}
    train = Trainer.train

    def observed_train(trainer, out, evaluate):  # checkpoints the initial parameters first
        seen["trainable"] = sum(len(getattr(trainer.task, n).trainable_variables) for n in family.networks)
        trainer.checkpointer.save()
        return train(trainer, out, evaluate)

    started, cpu = time.time(), time.process_time()
    Trainer.train = observed_train
    try:
        text = config.parse([os.path.join(ROOT, family.gin_file)], combo.bindings())
        experiment.run_experiment(model_dir=model_dir, mode="train", config_text=text)
    except errors.ConfigError as e:  # main.py prints the first line (gin appends where it was raised)
        return {"result": "refused", "error": str(e).strip().splitlines()[0], "exit_code": e.exit_code,
                "wrote": os.path.exists(model_dir), "seconds": time.time() - started,
                "cpu_seconds": time.process_time() - cpu}
    finally:
        Trainer.train = train
        gin.clear_config()
    checkpoints = os.path.join(model_dir, "checkpoints")
    start, end = (parameters(os.path.join(checkpoints, f"ckpt-{s}"), family.networks) for s in (0, STEPS))
    if len(end) != seen["trainable"]:
        raise AssertionError(f"{combo.key}: {len(end)} parameters in the checkpoint, but the networks have "
                             f"{seen['trainable']} trainable variables: update _STATE")
    np.savez(os.path.join(model_dir, "start.npz"), **start)
    np.savez(os.path.join(model_dir, "end.npz"), **end)
    return {"result": "ran", "model_dir": model_dir, "seconds": time.time() - started,
            "cpu_seconds": time.process_time() - cpu}


def run_group(group: int, work_dir: str, out_path: str, slow: bool) -> None:
    """Runs the in-process combinations of `group` one after another; writes their results."""
    results = {}
    for combo in combinations(slow):
        if _in_group(combo, group):
            results[combo.key] = _run_in_process(combo, work_dir)
            with open(out_path, "w", encoding="utf-8") as f:
                json.dump(results, f)


def _env(data_dir: str) -> dict:
    env = dict(os.environ, TFDS_DATA_DIR=str(data_dir), TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TF_CONFIG", None)
    return env


def _start_launch(combo: Combination, work_dir: str, data_dir: str):
    """Starts a cluster target's combination through the launcher, or a `via_main` one as
    `python main.py` alone; returns (process, log file, model_dir)."""
    family = FAMILIES[combo.family]
    model_dir = os.path.join(work_dir, combo.slug)
    launch = TARGETS[combo.target].launch
    command = ([sys.executable] + (["-m", "expframe.launch", *launch, "--"] if launch else [])
               + ["main.py", f"--gin_file={family.gin_file}", f"--model_dir={model_dir}", "--mode=train"]
               + [f"--gin_param={b}" for b in combo.bindings()])
    log = open(os.path.join(work_dir, combo.slug + ".log"), "w", encoding="utf-8")  # pylint: disable=consider-using-with
    proc = subprocess.Popen(command, cwd=ROOT, env=_env(data_dir), stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, log, model_dir


def _launch_result(combo: Combination, returncode: int, log_path: str, model_dir: str, seconds: float,
                   cpu_seconds: float) -> dict:
    with open(log_path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    # The launcher prefixes each process's lines (`[worker 0] error: ...`); main.py alone does not.
    errors = [m.group(1) for m in map(re.compile(r"^(?:\[[^\]]+\] )?error: (.*)$").match, lines) if m]
    timing = {"seconds": seconds, "cpu_seconds": cpu_seconds, "via": "launch" if TARGETS[combo.target].launch
              else "main.py", "output_lines": sum(bool(line.strip()) for line in lines)}
    if returncode != 0:
        refused = returncode == 2 and len(set(errors)) == 1  # every process said the same one line
        return {"result": "refused" if refused else "failed", "exit_code": returncode,
                "error": errors[0] if refused else "\n".join(lines[-20:]), "wrote": os.path.exists(model_dir),
                **timing}
    return {"result": "ran", "model_dir": model_dir, **timing}


def run_matrix(data_dir: str, work_dir: str, slow: bool = False, parallel: int = 3) -> Dict[str, dict]:
    """Runs the combinations (with `slow`, all; else those of the default tests; in-process
    groups and cluster launches, `parallel` at once, the costliest first) and returns each
    one's result with its agreement to its family's reference."""
    launches = [("launch", c) for c in combinations(slow) if TARGETS[c.target].launch or c.via_main]
    jobs = [("group", 0), launches[0], ("group", 1)] + launches[1:]
    running, results = [], {}
    while jobs or running:
        while jobs and len(running) < parallel:
            kind, what = jobs.pop(0)
            if kind == "group":
                out = os.path.join(work_dir, f"group{what}.json")
                command = [sys.executable, "-m", "tests.conformance.matrix", f"--run_group={what}",
                           f"--work_dir={work_dir}", f"--out={out}"] + (["--slow"] if slow else [])
                log = open(os.path.join(work_dir, f"group{what}.log"), "w", encoding="utf-8")  # pylint: disable=consider-using-with
                proc = subprocess.Popen(command, cwd=ROOT, env=_env(data_dir), stdout=log, stderr=subprocess.STDOUT)
                running.append((kind, what, proc, log, out, time.time()))
            else:
                proc, log, model_dir = _start_launch(what, work_dir, data_dir)
                running.append((kind, what, proc, log, model_dir, time.time()))
        time.sleep(0.2)
        for job in list(running):
            kind, what, proc, log, extra, started = job
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # its CPU time, children included
            if pid == 0:
                continue
            proc.returncode = os.waitstatus_to_exitcode(status)
            cpu_seconds = usage.ru_utime + usage.ru_stime
            running.remove(job)
            log.close()
            if kind == "group":
                if proc.returncode != 0:
                    with open(log.name, encoding="utf-8") as f:
                        raise RuntimeError(f"matrix group {what} failed:\n{f.read()[-5000:]}")
                with open(extra, encoding="utf-8") as f:
                    results.update(json.load(f))
                results[f"group {what}"] = {"result": "group", "seconds": time.time() - started,
                                            "cpu_seconds": cpu_seconds}
            else:
                results[what.key] = _launch_result(what, proc.returncode, log.name, extra, time.time() - started,
                                                   cpu_seconds)
    _compare(results, slow)
    return results


def _compare(results: Dict[str, dict], slow: bool, combos: Optional[Sequence[Combination]] = None) -> None:
    """Adds each run's agreement with its family's float32 1-replica reference (of
    `combos`; default: the matrix's, with `slow` or not)."""
    for combo in combinations(slow) if combos is None else combos:
        result = results[combo.key]
        if result["result"] != "ran":
            continue
        family = FAMILIES[combo.family]
        ref_dir = results[reference(combo.family).key]["model_dir"]
        ref_start = dict(np.load(os.path.join(ref_dir, "start.npz")))
        ref_end = dict(np.load(os.path.join(ref_dir, "end.npz")))
        own = os.path.join(result["model_dir"], "end.npz")
        if os.path.exists(own):
            end = dict(np.load(own))
            start = dict(np.load(os.path.join(result["model_dir"], "start.npz")))
            result["initial_max_abs_diff"] = float(max(np.abs(start[k] - ref_start[k]).max() for k in ref_start))
        else:  # a cluster run: its final checkpoint
            end = parameters(os.path.join(result["model_dir"], "checkpoints", f"ckpt-{STEPS}"), family.networks)
        result["agreement"] = agreement(end, ref_start, ref_end)


def run_target(target: str, families: Sequence[str] = ("classification", "sngan", "d4pg"),
               precisions: Sequence[str] = PRECISIONS) -> List[Dict[str, str]]:
    """The single-process families on one replica of `target` (e.g. 'gpu') at each
    precision, against their float32 run on one CPU replica, with the matrix's
    thresholds; the entry point of benchmarks/gpu_check.py.

    Returns:
      Rows {"combination", "result" ('matches', 'DOES NOT MATCH', 'refused: ...',
      'failed'), "agreement" (in words)}.
    """
    name = f"{target} x1"
    TARGETS.setdefault(name, Target(name, (f"Replicator.target = '{target}'", "Replicator.num_replicas = 1",
                                           "Replicator.mesh_shape = None")))
    work_dir = tempfile.mkdtemp(prefix="conformance_target_")
    os.environ["TFDS_DATA_DIR"] = data_dir = os.path.join(work_dir, "tfds")
    mr.build_shapes(data_dir)
    combos = [Combination(f, name, p) for f in families for p in precisions]
    results = {}
    for combo in [reference(f) for f in families] + combos:
        if combo.key not in results:
            try:
                results[combo.key] = _run_in_process(combo, work_dir)
            except Exception as e:  # pylint: disable=broad-except  # a row of the table, not a crash
                results[combo.key] = {"result": "failed", "error": f"{type(e).__name__}: {e}".splitlines()[0]}
    _compare(results, slow=True, combos=[c for c in combos if results[c.key]["result"] == "ran"])
    rows = []
    for combo in combos:
        result = results[combo.key]
        a = result.get("agreement")
        words = (f"max abs diff {a['max_abs_diff']:.2e}, update cosine {a['cosine']:.6f}, norm ratio "
                 f"{a['norm_ratio']:.4f}" if a else result.get("error", ""))
        rows.append({"combination": combo.key, "result": result_text(combo, result), "agreement": words})
    return rows


# -- the table -------------------------------------------------------------------------


def header() -> str:
    """The part of the document that the test compares exactly (no measured numbers)."""
    f16_cosine, bf16_cosine = MIXED_MIN_COSINE["mixed_float16"], MIXED_MIN_COSINE["mixed_bfloat16"]
    low, high = 1 - MIXED_NORM_TOLERANCE, 1 + MIXED_NORM_TOLERANCE
    notes = "".join(textwrap.fill(f"- {f.note}", 88, subsequent_indent="  ") + "\n"
                    for f in FAMILIES.values() if f.note)
    via = " and ".join(f"`{c.family}` on `{c.target}` at {c.precision}" for c in combinations() if c.via_main)
    via_main = textwrap.fill(
        f"A refusal in a group's process takes its exit status from the error's class; {via} runs "
        "as a user's command, `python main.py` in a process of its own, and its row checks that process: "
        "exit status 2, the one line all it printed, and no model_dir left behind.", 88)
    return f"""# Conformance matrix: same science on every path

Generated by `{REGENERATE}` from the data of
`tests/conformance/test_matrix.py` (in the default test suite), which checks that this
file's combinations, results and thresholds are what the code gives. The numbers depend
on the CPU (bfloat16 is native on some, emulated on others); regenerate them with the
command above.

Every shipped task family runs its shipped gin file shrunk by bindings (batch 4,
{STEPS} updates, tiny networks; `tests/conformance/matrix.py`) through `run_experiment`,
as `main.py` runs it, or through `python -m expframe.launch -- main.py` for the
cluster targets. A family's float32 run on one replica (`cpu x1`; `mesh 1x1` for the
mesh task) is its **reference**; every other combination either **matches** it or is
**refused** before any step is traced or anything is written, with one line (exit 2)
naming the binding to change.

{via_main}

- **Parameters**: the trainable variables of the family's networks after {STEPS} updates
  (batch-norm statistics and spectral-norm vectors are state and are left out); the
  **update** is parameters after minus the reference's initial parameters (every run
  starts from the same seeded initialisation).
- **float32**, on any target: max |parameter - reference| <= {FLOAT32_ATOL:g}.
- **mixed_float16**, **mixed_bfloat16**: cosine similarity of the update with the
  reference's > {f16_cosine:g} (float16) or > {bf16_cosine:g} (bfloat16), and its norm within
  {MIXED_NORM_TOLERANCE:.0%} of the reference's (norm ratio in [{low:g}, {high:g}]). Adam's first
  updates are about +-lr for every parameter whose gradient is clear of 0, so they flip
  where rounding moves a gradient across 0; bfloat16 keeps 8 bits of mantissa (float16
  11) and flips more of them.
- **parameter_server** is asynchronous: with several workers the order of updates is
  not defined, so it is compared with one worker, whose updates are applied in order.
- Refused rows on cluster targets are checked at float32; the check that refuses them
  comes before the precision matters. D4PG acts in its learner's process, which needs
  one host; the SN-GAN's generator synchronises batch statistics (`SyncBatchNorm`),
  which asynchronous parameter servers cannot.
{notes}
The `tests` column says where a combination runs: `default` in `python -m pytest`,
`slow` only in `python -m pytest -m slow tests/conformance/` and in the command above
(mixed precision on the cluster targets, and the compiled Keras model's on `cpu x2`, for
the default suite's time limit; the same model at the same precision is in the default
tests on `cpu x2`, and for the Keras model on `cpu x1`).

| family | target | precision | tests | result | max abs diff | update cosine | update norm ratio |
|---|---|---|---|---|---|---|---|
"""


def result_text(combo: Combination, result: dict) -> str:
    if combo.is_reference and result["result"] == "ran":
        return "reference"  # what the family's other rows are compared with, not compared with itself
    if result["result"] == "refused":
        binding = re.findall(r"[A-Za-z_]+\.[a-z_]+(?=\s*=)", result["error"])
        return f"refused: `{binding[0]}`" if binding else "refused"
    if result["result"] == "ran":
        return "matches" if passes(combo, result)[0] else "DOES NOT MATCH"
    return "failed"


def render(results: Dict[str, dict], measured: str) -> str:
    rows = []
    for combo in combinations():
        result = results[combo.key]
        a = None if combo.is_reference else result.get("agreement")
        numbers = (f"{a['max_abs_diff']:.2e} | {a['cosine']:.6f} | {a['norm_ratio']:.4f}" if a else "| |")
        rows.append(f"| {combo.key} | {combo.suite} | {result_text(combo, result)} | {numbers} |")
    ran = sum(r["result"] == "ran" for r in results.values())
    refused = sum(r["result"] == "refused" for r in results.values())
    return (header() + "\n".join(rows) + f"\n\n{len(rows)} combinations: {ran} run, {refused} refused. "
            f"Worst agreement with the float32 1-replica runs: {worst(results)}. Measured {measured}.\n")


def worst(results: Dict[str, dict]) -> str:
    """The worst agreement of the runs of each precision, in words."""
    parts = []
    for precision in PRECISIONS:
        found = [results[c.key]["agreement"] for c in combinations() if c.precision == precision
                 and results.get(c.key, {}).get("agreement")]
        if not found:
            continue
        if precision == "float32":
            parts.append(f"float32 max abs diff {max(a['max_abs_diff'] for a in found):.2e}")
        else:
            ratio = max((a["norm_ratio"] for a in found), key=lambda r: abs(r - 1))
            parts.append(f"{precision} cosine {min(a['cosine'] for a in found):.4f}, norm ratio {ratio:.4f}")
    return "; ".join(parts)


def table_rows(text: str) -> List[Tuple[str, str, str]]:
    """(combination, tests, result) of each row of a rendered table."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0] in FAMILIES:
            rows.append((" | ".join(cells[:3]), cells[3], cells[4]))
    return rows


def machine() -> str:
    """The CPU, whether it has native bfloat16, the date and the load average."""
    model, flags = "unknown CPU", ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
        model = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()
        flags = info
    except (OSError, AttributeError):
        pass
    native = "native bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "bfloat16 emulated"
    load = os.getloadavg()[0]
    return f"on {model} ({os.cpu_count()} cores, {native}), {datetime.date.today()}, load average {load:.1f}"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--run_group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work_dir")
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--data_dir", help="TFDS data dir (default: a temporary one with a small shapes build)")
    parser.add_argument("--write_docs", action="store_true", help=f"run the whole matrix and write {DOC}")
    parser.add_argument("--slow", action="store_true", help="with --run_group: the slow combinations too")
    args = parser.parse_args(argv)
    if args.run_group is not None:
        import expframe  # pylint: disable=import-outside-toplevel
        expframe.split_cpu(4)  # mesh 2x2 is the most a combination asks for
        run_group(args.run_group, args.work_dir, args.out, args.slow)
        # Its results are written: leave without the interpreter's teardown. Freeing the
        # tf.data iterators of a dozen runs in one process at exit waited on their threads
        # for about 100 s (seen on 2 cores beside the other group and the launches: the
        # process asleep in ~IteratorResource), with nothing left to do.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="conformance_")
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = os.path.join(work_dir, "tfds")
        mr.build_shapes(data_dir)
    load = os.getloadavg()[0]
    results = run_matrix(data_dir, work_dir, slow=True)
    failures = [f"{c.key}: {why}" for c in combinations() for ok, why in [passes(c, results[c.key])] if not ok]
    text = render(results, machine().replace(f"load average {os.getloadavg()[0]:.1f}",
                                             f"load average {load:.1f} at the start"))
    for key, result in results.items():  # where the time goes (not in the document: it depends on the machine)
        print(f"{key}: {result['result']}, {result['seconds']:.1f} s, {result.get('cpu_seconds', 0):.1f} s CPU",
              file=sys.stderr)
    if args.write_docs:
        with open(DOC, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {DOC}")
    else:
        print(text)
    for line in failures:
        print(f"FAILS: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
