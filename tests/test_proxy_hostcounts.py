"""Connections per client address, and in all, counted over the workers of a supervisor
(the shared table of ``gatehouse.proxy.hostcounts``), two workers' views of one memfd:
the limit is the sum, a dead worker's counts are zeroed, freed slots serve other
addresses, and a full table falls back to counting addresses per worker (never the
total: its slot is its own)."""

from __future__ import annotations

import logging

import pytest

from gatehouse.proxy import hostcounts
from gatehouse.proxy.hostcounts import HostCounts, HostTable, SharedHostCounts


def workers(n: int = 3) -> tuple[HostTable, list[SharedHostCounts]]:
    table = HostTable.create(n)
    return table, [SharedHostCounts(HostTable(table.fd, n), i) for i in range(n)]


def test_one_process_counts_in_a_dict() -> None:
    counts = HostCounts()
    assert counts.admit("10.0.0.1", 2) and counts.admit("10.0.0.1", 2)
    assert not counts.admit("10.0.0.1", 2)
    assert counts.admit("10.0.0.2", 2) and counts.admit("10.0.0.1", None)
    counts.release("10.0.0.1")
    counts.release("10.0.0.1")
    assert counts.open == {"10.0.0.1": 1, "10.0.0.2": 1}


def test_the_limit_is_over_all_workers() -> None:
    table, (first, second, third) = workers()
    assert first.admit("10.0.0.1", 3) and first.admit("10.0.0.1", 3)
    assert second.admit("10.0.0.1", 3)
    assert not third.admit("10.0.0.1", 3) and not first.admit("10.0.0.1", 3)
    assert third.admit("10.0.0.2", 3)  # another address: its own count
    assert table.total(hostcounts._key("10.0.0.1")) == 3
    first.release("10.0.0.1")
    assert third.admit("10.0.0.1", 3)
    assert not second.admit("10.0.0.1", 3)


def test_a_dead_workers_counts_are_zeroed() -> None:
    table, (first, second, _) = workers()
    for _ in range(3):
        assert first.admit("10.0.0.1", 4)
    assert second.admit("10.0.0.1", 4)
    assert not second.admit("10.0.0.1", 4)
    table.forget(0)  # the supervisor, before starting worker 0 again
    assert table.total(hostcounts._key("10.0.0.1")) == 1
    replacement = SharedHostCounts(HostTable(table.fd, 3), 0)
    assert sum(replacement.admit("10.0.0.1", 4) for _ in range(4)) == 3


def test_freed_slots_serve_other_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hostcounts, "SLOTS", 8)
    monkeypatch.setattr(hostcounts, "_PROBES", 8)
    table, (first, second, _) = workers()
    hosts = [f"10.0.1.{i}" for i in range(8)]
    assert all(first.admit(h, 1) for h in hosts)  # the table is full
    for host in hosts[:4]:
        first.release(host)
    fresh = [f"10.0.2.{i}" for i in range(4)]
    assert all(second.admit(h, 1) for h in fresh)  # in the slots the first four freed
    assert not second.admit(hosts[5], 1)  # still counted: its slot kept
    assert table.total(hostcounts._key(fresh[0])) == 1


def test_a_full_table_counts_per_worker(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(hostcounts, "SLOTS", 4)
    monkeypatch.setattr(hostcounts, "_PROBES", 4)
    caplog.set_level(logging.WARNING, logger="gatehouse.proxy")
    _, (first, second, _) = workers()
    assert all(first.admit(f"10.0.1.{i}", 1) for i in range(4))
    assert first.admit("10.9.9.9", 1) and second.admit("10.9.9.9", 1)  # per worker now
    assert not first.admit("10.9.9.9", 1)
    assert first.open == {"10.9.9.9": 1}
    first.release("10.9.9.9")
    assert first.open == {}
    assert [r.getMessage() for r in caplog.records].count(  # once by each worker
        "shared connection table full: new addresses are limited per worker") == 2


def test_the_proxys_connections_are_counted_over_all_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``limits.max_connections``: the whole proxy's, in the slot past the addresses'."""
    single = HostCounts()
    assert single.admit_total(2) and single.admit_total(2) and not single.admit_total(2)
    single.release_total()
    assert single.admit_total(2)

    monkeypatch.setattr(hostcounts, "SLOTS", 4)
    monkeypatch.setattr(hostcounts, "_PROBES", 4)
    table, (first, second, third) = workers()
    assert all(first.admit(f"10.0.1.{i}", 1) for i in range(4))  # the addresses' full
    assert first.admit_total(3) and first.admit_total(3) and second.admit_total(3)
    assert not third.admit_total(3) and not first.admit_total(3)
    assert table.total() == 3
    assert all(table.total(hostcounts._key(f"10.0.1.{i}")) == 1 for i in range(4))
    first.release_total()
    assert third.admit_total(3) and not second.admit_total(3)
    table.forget(0)  # worker 0 died holding one: the supervisor zeroes it
    assert table.total() == 2
    replacement = SharedHostCounts(HostTable(table.fd, 3), 0)
    assert replacement.admit_total(3) and not second.admit_total(3)
    replacement.release_total()
    replacement.release_total()  # more releases than admissions change nothing
    assert table.total() == 2
