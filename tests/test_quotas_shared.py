"""Quota buckets shared by the workers of one supervisor (``workers: N``): one table in
shared memory, each bucket's updates under a lock on its slot, one clock for every
process."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from gatehouse.proxy.quotas import MAX_HOLD, QuotaBuckets
from gatehouse.proxy.sharedquotas import SLOTS, SharedBucket, SharedTable
from gatehouse.rules.model import ClientFacts, Quota, Rule

pytestmark = pytest.mark.skipif(not SharedTable.supported(), reason="no memfd on this system")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_workers() -> tuple[SharedTable, SharedTable, FakeClock]:
    """The supervisor's table seen by two workers (two mappings of its memfd)."""
    clock = FakeClock()
    table = SharedTable.create()
    return SharedTable(table.fd, clock), SharedTable(table.fd, clock), clock


def test_workers_spend_from_one_bucket() -> None:
    first, second, clock = two_workers()
    a, b = first.slot("rule\0produce_bytes\0principal:alice", 1000.0), \
        second.slot("rule\0produce_bytes\0principal:alice", 1000.0)
    assert isinstance(a, SharedBucket) and isinstance(b, SharedBucket)
    assert a.index == b.index  # the same slot, found by key
    a.spend(1500, 0.0)  # a second's burst and half a second more, in one worker
    assert b.wait(0.0) == pytest.approx(0.5)  # ... is the other worker's debt too
    clock.now += 0.25
    assert a.wait(0.0) == pytest.approx(0.25)
    b.spend(10 * 1000 * MAX_HOLD, 0.0)
    assert a.wait(0.0) == pytest.approx(MAX_HOLD)  # capped as a local bucket is
    other = second.slot("rule\0produce_bytes\0principal:bob", 1000.0)
    assert other is not None and other.index != a.index and other.wait(0.0) == 0.0
    b.set_rate(2000.0, 0.0)
    assert a.rate == 2000.0 and a.wait(0.0) == pytest.approx(MAX_HOLD / 2)


def test_quota_buckets_use_the_shared_table() -> None:
    first, second, _ = two_workers()
    rule = Rule(name="team", quota=Quota(requests=10.0, per="principal"))
    facts = ClientFacts(principal="alice")
    mine, theirs = QuotaBuckets(), QuotaBuckets()
    mine.shared, theirs.shared = first, second
    [charge] = mine.charges((rule,), facts, 1, 0.0)
    [other] = theirs.charges((rule,), facts, 2, 0.0)
    assert isinstance(charge.bucket, SharedBucket)
    for _ in range(15):
        charge.bucket.spend(1, 0.0)
    assert other.bucket.wait(0.0) == pytest.approx(0.5)  # 5 requests over, at 10 a second


def test_a_full_neighbourhood_falls_back_to_a_workers_own_bucket() -> None:
    table = SharedTable(SharedTable.create().fd, FakeClock())
    for index in range(SLOTS):  # every slot taken by some other key
        table.write(index, index + 1, 0.0, 0.0, 1.0)
    assert table.slot("new", 1.0) is None
    buckets = QuotaBuckets()
    buckets.shared = table
    [charge] = buckets.charges((Rule(name="r", quota=Quota(requests=1.0, per="rule")),),
                               ClientFacts(), 1, 0.0)
    assert not isinstance(charge.bucket, SharedBucket)


def _add(fd: int, index: int, times: int) -> None:
    table = SharedTable(fd)
    for _ in range(times):
        with table.locked(index):
            key, level, at, rate = table.read(index)
            table.write(index, key, level + 1, at, rate)


def test_updates_from_several_processes_are_never_lost() -> None:
    table = SharedTable.create()
    table.write(7, 99, 0.0, 0.0, 1.0)
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_add, args=(table.fd, 7, 3000)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    assert table.read(7) == (99, 9000.0, 0.0, 1.0)
    os.close(table.fd)
