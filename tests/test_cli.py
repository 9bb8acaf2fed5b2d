"""The command line (issue 19, items 4-7): --help, --list_configurables, --dry_run,
Ctrl-C during start-up, errors of the right class, a quiet start. Every main.py run
here starts in a directory outside the clone; the runs of one test go side by side."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests import main_runner as mr

EXAMPLE = os.path.join(mr.ROOT, "examples", "regression")
NOISE = ("cuInit", "absl::InitializeLog", "cudart_stub", "cpu_feature_guard")


def _start(args, cwd, data_dir, ignore_sigint=False, env=None):
    """main.py with `args` in `cwd`, output merged; optionally with SIGINT ignored by
    inheritance, as a shell leaves it for a job started in the background."""
    def preexec():
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    return subprocess.Popen([sys.executable, mr.MAIN] + list(args), cwd=cwd, env=env or mr.env(data_dir),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec)


def _finish(proc, timeout=300):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def _example(tmp_path):
    folder = tmp_path / "my_regression"
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_help_exits_0_and_names_parsed_config(tmp_path):
    done = subprocess.run([sys.executable, mr.MAIN, "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for flag in ("--gin_file:", "--[no]dry_run:", "--[no]list_configurables:", "--gin_search_path:",
                 "--[no]tf_logs:", "--model_dir:"):
        assert flag in done.stdout, flag
    help_text = " ".join(done.stdout.split())
    assert "--[no]allow_config_change: Resume even if this run's configuration differs" in help_text
    assert "parsed_config.gin" in help_text.split("--[no]allow_config_change")[1].split("--")[0]


def test_list_configurables_and_dry_run(tmp_path, data_dir):
    """--list_configurables shows parameters and defaults (a user module's too); a dry
    run builds the task, prints the parsed config, and writes nothing; a binding only
    called while the task builds is checked by the dry run."""
    folder = _example(tmp_path)
    listing = _start(["--list_configurables", "--gin_file=regression.gin"], folder, data_dir)
    model_dir = tmp_path / "dry"
    dry = _start(["--gin_file=quickstart", "--dry_run", f"--model_dir={model_dir}"]
                 + [f"--gin_param={p}" for p in mr.SMALL], tmp_path, data_dir)
    bad = _start(["--gin_file=quickstart", "--dry_run", f"--model_dir={model_dir}"]
                 + [f"--gin_param={p}" for p in mr.SMALL + ("resnet.depth = 19",)], tmp_path, data_dir)
    code, out = _finish(listing)
    assert code == 0, out[-3000:]
    assert "Trainer  [expframe.trainer.Trainer]" in out and "    train_steps = None" in out
    assert "    global_batch_size = REQUIRED" in out and "    train_epochs = None" in out
    assert "    steps_per_loop = 100" in out and "    eval_steps = None" in out
    assert "RegressionTask  [regression_task.RegressionTask]" in out and "    model = REQUIRED" in out
    assert "mlp  [mlp_model.mlp]" in out and "    hidden = 64" in out
    assert "keras.optimizers.Adam  [keras.optimizers.Adam]" in out and "    learning_rate = 0.001" in out
    code, out = _finish(dry)
    assert code == 0, out[-3000:]
    assert "Trainer.global_batch_size = 16" in out and "resnet.depth = 8" in out  # the parsed config
    assert ("dry run: the configuration is valid: target 'cpu', 2 replica(s), global batch 16, 6 steps; "
            f"{model_dir} would start at step 0. Nothing was trained") in out
    assert not any(n in out for n in NOISE), out
    code, out = _finish(bad)
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "resnet.depth=19 is not a ResNet depth" in errors[0], out[-3000:]
    assert not model_dir.exists()


def _catches_sigint(pid, timeout=120):
    """Waits until process `pid` has a handler for SIGINT (/proc/<pid>/status SigCgt)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            caught = [int(line.split()[1], 16) for line in f if line.startswith("SigCgt:")]
        if caught and caught[0] & (1 << (signal.SIGINT - 1)):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never handled SIGINT")


def _wait_for(proc, needle, timeout=240):
    lines = mr.wait_for_line(proc, needle, timeout)
    return "".join(lines)


def test_sigint_during_start_up_stops_at_once_with_one_line(tmp_path, data_dir):
    """Ctrl-C while TensorFlow loads, while the data is generated, and while the first
    step is traced and run: exit 130 with one line, no checkpoint; never a run that
    trains on (it did, with SIGINT ignored as a background job inherits it)."""
    folder = _example(tmp_path)
    long_run = ["--gin_file=regression.gin", "--gin_param=Trainer.train_steps = 100000",
                "--gin_param=Trainer.steps_per_loop = 2000", "--mode=train"]
    fresh = tmp_path / "fresh_tfds"
    importing = _start(long_run + [f"--model_dir={tmp_path / 'a'}"], folder, data_dir, ignore_sigint=True)
    generating = _start(["--gin_file=" + os.path.join(mr.ROOT, "experiments", "quickstart.gin"),
                         f"--model_dir={tmp_path / 'b'}", "--gin_param=shapes_input.num_train = 3000",
                         "--gin_param=shapes_input.num_test = 64"], tmp_path, fresh, ignore_sigint=True)
    tracing = _start(long_run + [f"--model_dir={tmp_path / 'c'}"], folder, data_dir)
    _catches_sigint(importing.pid)  # expframe's handler is in (before TensorFlow is imported)
    time.sleep(0.5)
    importing.send_signal(signal.SIGINT)
    seen = {"generating": _wait_for(generating, "Generating"), "tracing": _wait_for(tracing, "model_dir ")}
    generating.send_signal(signal.SIGINT)
    tracing.send_signal(signal.SIGINT)
    for name, proc in (("importing", importing), ("generating", generating), ("tracing", tracing)):
        try:
            code, out = _finish(proc, timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{name}: SIGINT did not stop the run: {proc.communicate()[0][-2000:]}")
        out = seen.get(name, "") + out
        lines = [line for line in out.splitlines() if "stopped by SIGINT" in line]
        assert code == 130, (name, code, out[-3000:])
        assert len(lines) == 1 and lines[0].startswith(
            "expframe: stopped by SIGINT during start-up, before the first training step: nothing was trained"), (
            name, out[-3000:])
        assert "Traceback" not in out, (name, out[-3000:])
    for name in "abc":
        assert not (tmp_path / name / "checkpoints").exists(), name


def _wait_for_cpu_seconds(pid, seconds, limit_s=60.0):
    """Waits until the process has used `seconds` more CPU (/proc/<pid>/stat's utime + stime)."""
    def used():
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    start, deadline = used(), time.time() + limit_s
    while used() - start < seconds:
        assert time.time() < deadline, f"process {pid} used under {seconds} s of CPU in {limit_s:.0f} s"
        time.sleep(0.02)


def test_watchdog_ends_a_start_up_stuck_in_a_long_native_call(tmp_path):
    """The handler waits for the main thread to run Python; a long C call (here
    hashlib's, which releases the GIL like TensorFlow's ops) is ended by the watchdog.
    ('armed' is printed inside the try: a SIGINT that lands while print returns, as one
    did under load, is then caught too. The signal is sent once the child has used 0.3 s
    of CPU after 'armed', so inside the C call: one sent at once landed in CI before the
    call began, and the handler ran at once, without the watchdog.)"""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import hashlib, sys\nfrom expframe import interrupts\ninterrupts.GRACE_S = 1.0\ninterrupts.arm()\n"
        "try:\n    print('armed', flush=True)\n    hashlib.pbkdf2_hmac('sha256', b'x', b'y', 100_000_000)\n"
        "except interrupts.StartupInterrupt as e:\n    sys.exit(interrupts.report(e))\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONPATH=mr.ROOT))
    assert proc.stdout.readline() == "armed\n"
    _wait_for_cpu_seconds(proc.pid, 0.3)  # inside the C call: no Python left to run between them
    proc.send_signal(signal.SIGINT)
    code, out = _finish(proc, timeout=60)
    assert code == 130 and "stopped by SIGINT during start-up" in out and "(forced after 1 s)" in out, out


def test_task_contract_and_checkpoint_shape_errors_are_one_line_config_errors(tmp_path, data_dir):
    """A train_step without "loss", an eval_step without "count": one line naming the
    contract, exit 2. A checkpoint of another model resumed with --allow_config_change:
    exit 2, one line naming the variable and both shapes, no TensorFlow warnings."""
    folder = _example(tmp_path)
    (folder / "bad_tasks.py").write_text(
        "import gin\nfrom regression_task import RegressionTask\n\n\n@gin.configurable\n"
        "class NoLoss(RegressionTask):\n    def train_step(self, batch):\n"
        "        return {'mse': super().train_step(batch)['loss']}\n\n\n@gin.configurable\n"
        "class NoCount(RegressionTask):\n    def eval_step(self, batch):\n"
        "        out = super().eval_step(batch)\n        del out['count']\n        return out\n")
    (folder / "bad.gin").write_text("include 'regression.gin'\nimport bad_tasks\nNoLoss.model = @mlp\n"
                                    "NoLoss.dataset = @sine_waves\nNoLoss.optimizer = @keras.optimizers.Adam\n"
                                    "NoCount.model = @mlp\nNoCount.dataset = @sine_waves\n"
                                    "NoCount.optimizer = @keras.optimizers.Adam\n")
    short = ["--gin_param=Trainer.train_steps = 2", "--gin_param=Trainer.steps_per_loop = 1"]
    no_loss = _start(["--gin_file=bad.gin", "--gin_param=run_experiment.task = @NoLoss()",
                      f"--model_dir={tmp_path / 'l'}"] + short, folder, data_dir)
    no_count = _start(["--gin_file=bad.gin", "--gin_param=run_experiment.task = @NoCount()",
                       f"--model_dir={tmp_path / 'c'}"] + short, folder, data_dir)
    trained = _start(["--gin_file=regression.gin", f"--model_dir={tmp_path / 'm'}", "--mode=train"] + short,
                     folder, data_dir)
    expected = [(no_loss, "error: NoLoss.train_step returned a dict with the keys ['mse'], without 'loss': a train "
                          "step returns a dict of per-replica scalars with the key 'loss'"),
                (no_count, "error: NoCount.eval_step returned a dict with the keys ['mae', 'mse'], without 'count'")]
    for proc, line in expected:
        code, out = _finish(proc)
        errors = [x for x in out.splitlines() if x.startswith("error:")]
        assert code == 2 and len(errors) == 1 and errors[0].startswith(line), out[-3000:]
        assert "Traceback" not in out and "KeyError" not in out
    code, out = _finish(trained)
    assert code == 0, out[-3000:]
    changed = _start(["--gin_file=regression.gin", f"--model_dir={tmp_path / 'm'}", "--mode=train",
                      "--allow_config_change", "--gin_param=mlp.hidden = 32"] + short, folder, data_dir)
    code, out = _finish(changed)
    errors = [x for x in out.splitlines() if x.startswith("error:")]
    assert code == 2 and len(errors) == 1, out[-3000:]
    assert errors[0].startswith(f"error: the checkpoint {tmp_path / 'm' / 'checkpoints' / 'ckpt-2'} does not fit "
                                "this experiment's model: 'dense/kernel' (model/"), errors[0]
    assert "has shape (8, 64) in the checkpoint and (8, 32) in the model" in errors[0]
    assert "unrestored" not in out and "Traceback" not in out and len(out.strip().splitlines()) <= 3, out


def test_quiet_start_drops_only_tensorflows_start_up_notices(tmp_path):
    """fd 2 filtered: the known notices go, other lines (real warnings) pass in order."""
    script = tmp_path / "noise.py"
    script.write_text(
        "import os\nfrom expframe import tf_noise\nwith tf_noise.quiet_start() as hidden:\n"
        "    os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to "
        "STDERR\\n')\n"
        "    os.write(2, b'E0000 00:00:1.2 7 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error\\n')\n"
        "    os.write(2, b'E0000 00:00:1.3 7 some_op.cc:9] a real error\\n')\n"
        "    os.write(2, b'I0000 00:00:1.4 7 cudart_stub.cc:31] Could not find cuda drivers on your machine, x\\n')\n"
        "    os.write(2, b'W0000 00:00:1.5 7 other.cc:3] a real warning\\n')\n"
        "print(len(hidden), flush=True)\nos.write(2, b'after: not filtered cuInit\\n')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=mr.ROOT))
    assert done.stdout.strip() == "3", done.stdout + done.stderr
    assert done.stderr.splitlines() == ["E0000 00:00:1.3 7 some_op.cc:9] a real error",
                                        "W0000 00:00:1.5 7 other.cc:3] a real warning",
                                        "after: not filtered cuInit"], done.stderr


# Errors that need no TensorFlow: (flags, the error line). Each came after TensorFlow
# was imported (4.5-12 s); now before it.
NO_TENSORFLOW_ERRORS = [
    ([], "error: --gin_file is required (e.g. --gin_file=experiments/quickstart.gin"),
    (["--gin_file=i31_no_such.gin"], "error: --gin_file=i31_no_such.gin: no such file (looked in the working "
                                     "directory"),
    (["--gin_file=quickstart", "--gin_search_path=i31_no_such_dir"],
     "error: --gin_search_path=i31_no_such_dir: no such folder."),
    (["--gin_file=quickstart", "--modle=train"], "error: Unknown command line flag 'modle'"),
    (["--gin_file=quickstart", "--mode=evaluate"], "error: flag --mode=evaluate: value should be one of"),
    (["--gin_file=quickstart", "surplus"], "error: unexpected arguments ['surplus']; pass settings with --gin_param"),
]
# The program as main.py runs it, reporting at exit whether TensorFlow was imported.
_REPORT_TF = ("import atexit, sys\n"
              "atexit.register(lambda: print('tensorflow imported:', 'tensorflow' in sys.modules))\n"
              "sys.argv[0] = 'main.py'\n"
              "from expframe.cli import main\n"
              "main()\n")


def test_errors_that_need_no_tensorflow_come_before_it_is_imported(tmp_path):
    env = dict(mr.env(str(tmp_path)), PYTHONPATH=os.pathsep.join([mr.ROOT, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", _REPORT_TF] + flags, cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for flags, _ in NO_TENSORFLOW_ERRORS]
    for proc, (flags, expected) in zip(procs, NO_TENSORFLOW_ERRORS, strict=True):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2, (flags, out, err)
        assert err.startswith(expected) and len(err.strip().splitlines()) == 1, (flags, err)
        assert out.strip() == "tensorflow imported: False", (flags, out, err)
