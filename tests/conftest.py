"""Test session set-up: split the CPU before any TensorFlow op runs, quiet logs."""

import atexit
import os
import shutil
import signal
import tempfile
import warnings

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TFDS_DISABLE_GCS", "1")
# Under pytest-xdist (`-n`, on by default: pyproject.toml) each worker process builds its
# TFDS data sets in its own subfolder, so two workers never write one build at once.
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("TFDS_DATA_DIR"):
    os.environ["TFDS_DATA_DIR"] = os.path.join(os.environ["TFDS_DATA_DIR"], os.environ["PYTEST_XDIST_WORKER"])
# Measured choices ('auto' precision and XLA) go to a cache of this test session, never
# to the user's (~/.cache/expframe); main.py subprocesses inherit it.
os.environ["EXPFRAME_CACHE_DIR"] = tempfile.mkdtemp(prefix="expframe_test_cache_")
atexit.register(shutil.rmtree, os.environ["EXPFRAME_CACHE_DIR"], True)

import expframe  # noqa: E402
from expframe import tf_noise  # noqa: E402


def _runs_no_tests(config) -> bool:
    """Whether this process is pytest-xdist's controller, which hands the tests to its
    workers and runs none itself (not under --collect-only, where it collects them)."""
    return (not hasattr(config, "workerinput") and not config.getoption("collectonly", False)
            and config.getoption("dist", "no") != "no" and bool(config.getoption("tx", None)))


def _sigint_as_from_a_terminal() -> None:
    """SIGINT raises KeyboardInterrupt here and in every child, whoever started pytest. A
    shell without job control (a script's `cmd &`) starts background commands with SIGINT
    ignored, and children inherit that: a study started by a test then ran on after its
    Ctrl-C, and an ActorPool never saw the learner's SIGINT (it chains only a handler it
    can call). Both failed in every background run of the suite, and passed in the
    foreground and in CI."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    """Distribution tests run 1 to 8 replicas in one process; TensorFlow lets a process
    split its CPU only once, so do it before any test module is imported.

    Not in the xdist controller: TensorFlow there costs seconds, and its start-up notices
    (`failed call to cuInit`), written to fd 2 while pytest captured it, came out after
    the summary line as the process exited. Where TensorFlow starts, its notices are
    dropped as main.py drops them (expframe.tf_noise)."""
    _sigint_as_from_a_terminal()   # in the controller (its workers inherit it) and in each worker
    if _runs_no_tests(config):
        return
    with tf_noise.quiet_start():
        expframe.split_cpu(8)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one test process per core, at most 4 (each holds TensorFlow and may start
    a cluster of several more; EXPFRAME_TEST_WORKERS overrides)."""
    if os.environ.get("EXPFRAME_TEST_WORKERS"):
        return int(os.environ["EXPFRAME_TEST_WORKERS"])
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`-m slow` (learning runs, benchmarks) runs in one process, one test at a time, as
    those runs are timed alone; pass `-n N` explicitly after `-m slow` to override."""
    if "slow" in (config.option.markexpr or "").replace("not slow", "") and not _explicit_workers(config):
        config.option.numprocesses = 0
        config.option.dist = "no"


def _explicit_workers(config) -> bool:
    """Whether the command line itself (not pyproject's addopts) sets xdist's -n."""
    return any(a.startswith(("-n", "--numprocesses")) for a in config.invocation_params.args)


# The longest files, longest first (seconds in one full run on 2 cores, 2026-12-03: 616,
# 488, 258, 196, 157, 150, 140, 138, 114, 108, 99, 98, 96; test_d4pg_resume and
# test_d4pg_lockstep, added later, about 110 and 100), handed out first so that under
# xdist no process is left running one of them alone at the end (pyproject.toml passes
# --no-loadscope-reorder: xdist keeps this order).
LONGEST_FIRST = ("tests/conformance/test_matrix.py", "tests/test_stop_matrix.py", "tests/test_recovery.py",
                 "tests/test_d4pg_pixels_experiments.py", "tests/test_d4pg_distributed.py",
                 "tests/test_multi_worker.py", "tests/test_main.py", "tests/test_d4pg_resume.py",
                 "tests/test_d4pg_lockstep.py", "tests/test_after_training.py",
                 "tests/test_vit_mesh_experiments.py",
                 "tests/test_reproduce.py", "tests/test_sngan_experiments.py", "tests/test_d4pg_experiments.py",
                 "tests/test_resume_across_replicas.py", "tests/test_export.py", "tests/test_trainer.py")


def _file_rank(item) -> int:
    path = item.nodeid.split("::")[0]
    return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """Deselects `tf.test.TestCase.test_session`: a deprecated context manager, not a
    test, which pytest collects from every tf.test.TestCase subclass and then skips.
    Puts the longest files first (a stable sort: the order inside a file is kept)."""
    items.sort(key=_file_rank)
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    placeholder = tf.test.TestCase.test_session
    kept, dropped = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        is_placeholder = (cls is not None and item.originalname == "test_session"
                          and getattr(cls, "test_session", None) is placeholder)
        (dropped if is_placeholder else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A TFDS data dir with a small `shapes` build (512 train / 64 test) for main.py runs."""
    path = tmp_path_factory.mktemp("tfds")
    from tests import main_runner  # pylint: disable=import-outside-toplevel
    main_runner.build_shapes(path)
    return path


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture(autouse=True)
def _signal_handlers_as_found(request):
    """Each test leaves SIGINT and SIGTERM as it found them (a warning names a test that did
    not): a test that left SIGINT ignored, say, would make later tests in its worker lose
    the signal (`_sigint_as_from_a_terminal`)."""
    found = {s: signal.getsignal(s) for s in _STOP_SIGNALS}
    yield
    for signum, handler in found.items():
        now = signal.getsignal(signum)
        if handler is not None and now is not handler:
            warnings.warn(f"{request.node.nodeid} left {signal.Signals(signum).name} as {now!r} (was {handler!r}); "
                          "put back", stacklevel=1)
            signal.signal(signum, handler)
