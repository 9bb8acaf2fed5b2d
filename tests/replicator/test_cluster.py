"""A lost peer's TensorFlow error becomes one line (WorkerLostError); main.py then exits at once."""

import pytest
import tensorflow as tf

from expframe.errors import RunError, WorkerLostError
from expframe.replicator import cluster

# What a worker's train step raised when its peer was SIGSTOPped (a collective inside
# the traced step, aborted by the coordination service's missing heartbeats).
_HUNG_PEER = """Graph execution error:

Detected at node resnet8_1/stem_bn_1/allgather/CollectiveGatherV2 defined at (most recent call last):
  File "main.py", line 65, in <module>

  File "expframe/layers/sync_batch_norm.py", line 99, in call

Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are unhealthy (stopped \
sending heartbeats):
/job:worker/replica:0/task:1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) \
to debug further.
The error could be from a previous operation. Restart your program to reset.
\t [[{{node resnet8_1/stem_bn_1/allgather/CollectiveGatherV2}}]] [Op:__inference_host_call_1234]"""
# ... and when its peer was SIGKILLed (an eager collective).
_DEAD_PEER = """{{function_node __inference_<lambda>_33}} Collective ops is aborted by: Socket closed
Additional GRPC error information from remote target /job:worker/replica:0/task:0 while calling \
/tensorflow.WorkerService/RecvBuf:
:UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}
\t [[{{node CollectiveReduceV2}}]] [Op:__inference_<lambda>_33]"""


@pytest.mark.parametrize("message, cause", [
    (_HUNG_PEER, "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are "
                 "unhealthy (stopped sending heartbeats): /job:worker/replica:0/task:1"),
    (_DEAD_PEER, "Collective ops is aborted by: Socket closed"),
])
def test_a_lost_peer_is_one_line_naming_the_cause_and_the_checkpoint(message, cause):
    with pytest.raises(WorkerLostError) as raised:
        with cluster.lost_worker_is_a_run_error(2, "/runs/x/checkpoints"):
            raise tf.errors.UnavailableError(None, None, message)
    assert str(raised.value) == (
        f"the cluster lost a worker (UnavailableError: {cause}); the last checkpoint in /runs/x/checkpoints is "
        "intact: rerun the same command to resume (`python -m expframe.launch --max_restarts=N` restarts on its "
        "own).")
    assert isinstance(raised.value, RunError) and raised.value.exit_code == 1


def test_on_one_worker_and_for_other_errors_nothing_is_translated():
    with pytest.raises(tf.errors.UnavailableError):
        with cluster.lost_worker_is_a_run_error(1, "/runs/x/checkpoints"):
            raise tf.errors.UnavailableError(None, None, _DEAD_PEER)
    with pytest.raises(tf.errors.InvalidArgumentError):
        with cluster.lost_worker_is_a_run_error(2, "/runs/x/checkpoints"):
            raise tf.errors.InvalidArgumentError(None, None, "bad shape")
