"""Cluster plumbing for the multi-process targets: fault detection and TF servers.

Lives in the replicator package because it touches TensorFlow's distributed runtime.
"""

import atexit
import contextlib
import json
import os
import re
import sys
from typing import Iterator, Optional

from expframe.errors import WorkerLostError

HEARTBEAT_ENV = "EXPFRAME_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0


def configure_fault_detection(timeout_s: Optional[float] = None, cluster_def: Optional[dict] = None) -> bool:
    """Sets the coordination service's heartbeat timeout for this process's cluster.

    TensorFlow's multi-worker strategies run a coordination service (on worker 0, the
    chief, or ps 0) to which every task sends heartbeats; a task that misses them for
    `heartbeat_timeout_in_ms` is declared dead and the error reaches every other task,
    which then fails its pending collectives instead of waiting forever. The agents
    send a heartbeat every timeout/2. MultiWorkerMirroredStrategy leaves the timeout
    at TensorFlow's default (10 s) and ParameterServerStrategy at 5 s; both configure
    the service only when nothing configured it before, so calling this first, before
    the strategy and before any TensorFlow op runs, sets our timeout instead.

    The config mirrors what the strategies would build (service leader, coordinated
    jobs), plus the timeout. It is a no-op without a cluster, or with a timeout <= 0.

    Args:
      timeout_s: heartbeat timeout in seconds; default `$EXPFRAME_HEARTBEAT_TIMEOUT_S`,
        else 5.
      cluster_def: the cluster as {job: [addresses]} (from the cluster resolver);
        default the cluster in `TF_CONFIG`.

    Returns:
      True if the coordination service was configured here.
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get(HEARTBEAT_ENV, DEFAULT_HEARTBEAT_TIMEOUT_S))
    if cluster_def is None:
        raw = os.environ.get("TF_CONFIG")
        cluster_def = (json.loads(raw).get("cluster") or {}) if raw else {}
    cluster = {job: list(tasks) for job, tasks in cluster_def.items()}
    if not cluster or timeout_s <= 0:
        return False
    # pylint: disable=g-import-not-at-top
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context
    ctx = context.context()
    if ctx.coordination_service is not None:
        return False
    if "ps" in cluster:  # ParameterServerStrategy: the coordinator (chief) sets it up.
        jobs, reconnect = ("worker", "ps"), True
    else:  # MultiWorkerMirroredStrategy: every worker (and chief) does.
        jobs, reconnect = ("chief", "worker"), False
    ctx.configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster),
        heartbeat_timeout_in_ms=int(timeout_s * 1000),
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=j, num_tasks=len(cluster[j]))
                          for j in jobs if j in cluster],
        allow_new_incarnation_to_reconnect=reconnect)
    return True


@contextlib.contextmanager
def lost_worker_is_a_run_error(num_workers: int, checkpoint_dir: str) -> Iterator[None]:
    """Turns TensorFlow's errors for a lost peer into a `WorkerLostError` (one line, exit 1).

    When a worker dies or hangs, the others' pending collectives fail with
    UnavailableError (its heartbeats stopped, or its connection is gone), AbortedError
    or DeadlineExceededError. On one worker these errors are not about peers, and pass.
    """
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    try:
        yield
    except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError) as e:
        if num_workers <= 1:
            raise
        raise WorkerLostError(
            f"the cluster lost a worker ({type(e).__name__}: {lost_worker_cause(e.message)}); the last checkpoint in "
            f"{checkpoint_dir} is "
            "intact: rerun the same command to resume (`python -m expframe.launch --max_restarts=N` restarts "
            "on its own).") from None


_CAUSES = ("aborted by", "unhealthy", "heartbeat", "socket closed", "connection", "failed to connect", "deadline")
_NOISE = ("File ", "Graph execution error", "Detected at node", "[[", "Additional GRPC error", "The error could be")


def lost_worker_cause(message: str) -> str:
    """The line of a TensorFlow error message that says why the peer is lost (at most 240
    characters): the first naming a cause (aborted collectives, missing heartbeats, a
    closed connection), not the traceback of the op that noticed; with the next line
    when it ends with a colon (the task it names)."""
    lines = [line.strip() for line in re.sub(r"\{\{function_node [^}]*\}\}", "", message).splitlines()]
    lines = [line for line in lines
             if line and not line.startswith(_NOISE) and not line.endswith("(most recent call last):")]
    if not lines:
        return "no message"
    at = next((i for i, line in enumerate(lines) if any(c in line.lower() for c in _CAUSES)), 0)
    cause = lines[at] + (" " + lines[at + 1] if lines[at].endswith(":") and at + 1 < len(lines) else "")
    return cause if len(cause) <= 240 else cause[:237] + "..."


def exit_now(status: int) -> None:
    """Ends this process at once with `status`, after Python's exit handlers, without
    TensorFlow's own teardown: after a lost worker, that teardown waits for the lost
    peer (3 to 7 s measured with a SIGSTOPped worker), which delays every restart."""
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()  # pylint: disable=protected-access  (logging, actor pools, ...)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # pylint: disable=protected-access


def serve() -> None:
    """Runs a TensorFlow server for this process's `TF_CONFIG` task until killed."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    config = json.loads(os.environ["TF_CONFIG"])
    cluster, task = config["cluster"], config["task"]
    proto = tf.compat.v1.ConfigProto()
    # Known hang (TF parameter-server tutorial): a worker with fewer inter-op threads
    # than workers + 1 can deadlock while the coordinator schedules functions on it.
    proto.inter_op_parallelism_threads = max(len(cluster.get("worker", ())) + 1, os.cpu_count() or 1)
    server = tf.distribute.Server(
        tf.train.ClusterSpec(cluster), job_name=task["type"], task_index=int(task["index"]),
        protocol="grpc", config=proto, start=True)
    print(f"serving {task['type']} {task['index']} at {cluster[task['type']][int(task['index'])]}",
          flush=True)
    server.join()
