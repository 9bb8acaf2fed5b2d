"""Lockstep bookkeeping (`expframe.rl.lockstep`) and the learner's service in lockstep: which
weights a chunk acts with and the order the learner takes chunks in depend on counts only."""

import threading

import numpy as np
import pytest

from expframe.rl.lockstep import Lockstep
from expframe.rl.rpc import ActorClient, LearnerService


def _chunk(actor_id, r, rows=3):
    return {"reward": np.full(rows, 10 * actor_id + r, np.float32)}


def test_rounds_act_with_the_version_assigned_when_published():
    lock = Lockstep(2)
    assert lock.fetch(0) is None                      # nothing assigned: the actor waits
    lock.assign(2, version=0, weights=["w0"])
    assert lock.fetch(0) == (0, ["w0"]) and lock.fetch(1) == (0, ["w0"])
    for r in range(2):
        assert lock.add(0, _chunk(0, r), [], 0)
    assert lock.fetch(0) is None                      # actor 0 is two rounds ahead: it waits
    assert not lock.add(0, _chunk(0, 2), [], 0)       # and may not send a third
    lock.assign(4, version=10, weights=["w10"])       # rounds 2 and 3 get step 10's weights
    lock.assign(3, version=20, weights=["w20"])       # already assigned: no change
    assert lock.fetch(0) == (10, ["w10"]) and lock.fetch(1) == (0, ["w0"])
    assert set(lock.weights) == {0, 10}               # step 20's weights: no round needs them


def test_the_learner_takes_whole_rounds_in_round_then_actor_order_whatever_the_arrival_order():
    orders = [[(1, 0), (1, 1), (0, 0), (0, 1)], [(0, 0), (1, 0), (1, 1), (0, 1)], [(0, 1), (0, 0), (1, 0), (1, 1)]]
    taken = []
    for order in orders:
        lock = Lockstep(2)
        lock.assign(2, 0, ["w"])
        sent = {0: 0, 1: 0}
        for actor_id, _ in order:
            lock.add(actor_id, _chunk(actor_id, sent[actor_id]), [float(actor_id)], 0)
            sent[actor_id] += 1
        assert lock.complete() == 2 and lock.rows == 12
        taken.append([(a, float(f["reward"][0])) for a, f, _, _ in lock.take(2)])
        assert lock.rows == 0 and lock.taken == 2 and not lock.versions and not lock.weights
    assert taken[0] == taken[1] == taken[2] == [(0, 0.0), (1, 10.0), (0, 1.0), (1, 11.0)]


def test_an_incomplete_round_is_not_taken_and_take_stops_at_upto():
    lock = Lockstep(2)
    lock.assign(3, 0, ["w"])
    for r in range(3):
        lock.add(0, _chunk(0, r), [], 0)
    lock.add(1, _chunk(1, 0), [], 0)
    assert lock.complete() == 1
    assert [a for a, *_ in lock.take(5)] == [0, 1]
    lock.add(1, _chunk(1, 1), [], 0)
    lock.add(1, _chunk(1, 2), [], 0)
    assert [float(f["reward"][0]) for _, f, _, _ in lock.take(2)] == [1.0, 11.0]   # round 1 only
    assert lock.taken == 2 and lock.complete() == 3


def test_the_service_makes_an_actor_wait_for_its_round_and_counts_lags_when_taken():
    weights = [np.zeros(2, np.float32)]
    service = LearnerService(weights, {"reward": ()}, capacity=100, lockstep=1, insert_wait_s=0.01)
    try:
        client = ActorClient(service.address, 0, timeout_s=10)
        got = []
        fetcher = threading.Thread(target=lambda: got.append(client.weights()))
        fetcher.start()
        fetcher.join(0.3)
        assert fetcher.is_alive() and not got           # no round assigned yet: WAIT, asked again
        service.publish([np.ones(2, np.float32)], step=0, rounds=2)
        fetcher.join(10)
        assert got[0][0] == 0 and np.array_equal(got[0][1][0], np.ones(2))
        assert client.insert(0, {"reward": np.ones(4, np.float32)}, [5.0]) == 1
        service.publish([np.full(2, 7.0, np.float32)], step=20, rounds=2)   # rounds 0, 1 keep version 0
        version, fetched = client.weights()
        assert version == 0 and np.array_equal(fetched[0], np.ones(2))
        assert client.insert(0, {"reward": np.ones(2, np.float32)}, []) == 1
        assert service.wait_for_rounds(2, timeout=1.0)
        chunks = service.take_rounds(2, step=30)
        assert [len(f["reward"]) for _, f, _, _ in chunks] == [4, 2]
        assert service.take_lags() == {30: 6} and service.take_returns() == [5.0]
    finally:
        service.close()


@pytest.mark.parametrize("actors", [1, 3])
def test_chunks_sent_by_threads_in_any_timing_reach_the_learner_in_one_order(actors):
    """Actors as threads with random sleeps, over the real RPC service: the learner's take
    order and each chunk's version are the same in every repetition."""
    results = []
    for repetition in range(2):
        service = LearnerService([np.zeros(1, np.float32)], {"reward": ()}, capacity=1000, lockstep=actors,
                                 insert_wait_s=0.01)
        rng = np.random.default_rng(repetition)
        delays = rng.uniform(0, 0.02, size=(actors, 6))

        def act(actor_id, service=service, delays=delays):
            client = ActorClient(service.address, actor_id, timeout_s=10)
            for c in range(6):
                version, weights = client.weights()
                if version < 0:
                    return
                threading.Event().wait(delays[actor_id, c])
                value = float(weights[0][0]) * 100 + actor_id * 10 + c
                client.insert(version, {"reward": np.full(2, value, np.float32)}, [])

        threads = [threading.Thread(target=act, args=(a,)) for a in range(actors)]
        try:
            for thread in threads:
                thread.start()
            order = []
            for step in (0, 2, 4):   # host calls of 2 learner steps; 2 rounds each, one call ahead
                service.publish([np.full(1, step, np.float32)], step=step, rounds=2 * (step // 2 + 2))
                assert service.wait_for_rounds(step + 2, timeout=20)
                order += [(a, v, float(f["reward"][0])) for a, f, _, v in service.take_rounds(step + 2, step)]
        finally:
            service.close()
            for thread in threads:
                thread.join(10)
        results.append(order)
    assert len(results[0]) == 6 * actors and results[0] == results[1]
