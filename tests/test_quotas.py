"""Rules' quotas: the token buckets, the rule syntax, and the pumps holding a client's
requests back (memory streams, trio's autojump clock: the times are exact)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from gatehouse import codecs
from gatehouse.configfile import ConfigError, load_yaml_text
from gatehouse.proxy.hooks import ConnectionInfo, Observer
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.proxy.quotas import MAX_HOLD, Bucket, QuotaBuckets
from gatehouse.rules import ClientFacts, parse_rules
from gatehouse.rules.model import Outcome, Quota
from tests.support.fakebroker import request, response_body
from tests.test_proxy_pumps import echo_handler, proxied
from tests.test_proxy_stream import RECORDS, fetch_answer, produce_answer, produce_wire


def policy_of(text: str) -> tuple[RulesPolicy, list[Outcome], list[tuple[str, float]]]:
    policy = RulesPolicy(parse_rules(load_yaml_text(text, "rules.yaml"), "rules.yaml"))
    outcomes: list[Outcome] = []
    held: list[tuple[str, float]] = []
    policy.outcome_listeners.append(outcomes.append)
    policy.throttle_listeners.append(lambda rule, seconds: held.append((rule, seconds)))
    return policy, outcomes, held


def throttles(outcomes: list[Outcome]) -> list[tuple[str, str]]:
    return [(o.rule, o.mode) for o in outcomes if o.effect == "throttle"]


# -- the bucket ----------------------------------------------------------------------------

def test_a_bucket_lends_a_seconds_worth_then_counts_the_debt() -> None:
    bucket = Bucket(100.0)
    bucket.spend(100, now=0.0)  # the burst: a second's worth at once
    assert bucket.wait(0.0) == 0.0
    bucket.spend(50, now=0.0)
    assert bucket.wait(0.0) == pytest.approx(0.5)
    assert bucket.wait(0.25) == pytest.approx(0.25)  # refilling at the rate
    assert bucket.wait(0.5) == 0.0
    assert bucket.wait(10.0) == 0.0 and bucket.idle(10.0)  # full again, never more
    bucket.spend(150, now=10.0)
    assert bucket.wait(10.0) == pytest.approx(0.5)


def test_a_bucket_never_owes_more_than_max_hold_seconds() -> None:
    bucket = Bucket(1000.0)
    bucket.spend(10_000_000, now=0.0)  # one enormous answer
    assert bucket.wait(0.0) == pytest.approx(MAX_HOLD)


def test_buckets_are_shared_by_scope_and_bounded() -> None:
    rules = parse_rules([{"name": "q", "quota": {"requests_per_second": 10,
                                                 "per": "client_id"}}]).rules
    buckets = QuotaBuckets(max_buckets=4)
    [a] = buckets.charges(rules, ClientFacts(client_id="a"), 1, 0.0)
    [again] = buckets.charges(rules, ClientFacts(client_id="a"), 2, 0.0)
    assert again.bucket is a.bucket
    a.bucket.spend(50, 0.0)  # in debt: remembered past the cap
    for name in "bcdefgh":
        buckets.charges(rules, ClientFacts(client_id=name), 3, 0.0)
    assert len(buckets.buckets) <= 4
    assert ("q", "requests", "client_id:a") in buckets.buckets


@pytest.mark.parametrize("per, facts, expected", [
    ("principal", ClientFacts(principal="alice", client_id="x"), "principal:alice"),
    ("principal", ClientFacts(client_id="x"), "client_id:x"),  # as a broker falls back
    ("client_id", ClientFacts(principal="alice", client_id="x"), "client_id:x"),
    ("source", ClientFacts(address="10.1.2.3:4567"), "source:10.1.2.3"),
    ("source", ClientFacts(address="[::1]:4567"), "source:::1"),
    ("connection", ClientFacts(), "connection:7"),
    ("rule", ClientFacts(principal="alice"), "rule"),
])
def test_scopes(per: str, facts: ClientFacts, expected: str) -> None:
    assert Quota(requests=1.0, per=per).scope_key(facts, 7) == expected


# -- the rule ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, line, message", [
    ("- name: q\n  quota: {}\n", 2, "quota needs produce_bytes_per_second"),
    ("- name: q\n  quota:\n    requests_per_second: 0\n", 3,
     "quota.requests_per_second must be positive, not 0"),
    ("- name: q\n  quota:\n    fetch_bytes_per_second: fast\n", 3,
     "must be an integer or a number"),
    ("- name: q\n  quota:\n    requests_per_second: 1\n    per: team\n", 4,
     "quota.per must be one of principal, client_id, source, connection, rule, not 'team'"),
    ("- name: q\n  quota:\n    request_per_second: 1\n", 3, "request_per_second"),
])
def test_quota_mistakes_say_file_and_line(text: str, line: int, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_rules(load_yaml_text(text, "rules.yaml"), "rules.yaml")
    assert str(info.value).startswith(f"rules.yaml:{line}: "), str(info.value)
    assert message in str(info.value)


# -- the pumps -------------------------------------------------------------------------------

REQUESTS_QUOTA = """
- name: calm
  quota: {requests_per_second: 5, per: connection}
"""


async def test_requests_past_the_rate_are_held_back(
        autojump_clock: trio.testing.MockClock) -> None:
    policy, outcomes, held = policy_of(REQUESTS_QUOTA)
    async with proxied(echo_handler, policy=policy) as h:
        for i in range(20):
            await h.client.send(request(3, 12, i).encode())
            assert await h.client.receive() is not None
        # Six at once (a second's burst, and one more on credit: a request goes on
        # while nothing is owed), then one every 0.2 s: the 20th after 2.8 s.
        assert trio.current_time() == pytest.approx(2.8, abs=0.01)
    assert len(throttles(outcomes)) == 14
    assert set(throttles(outcomes)) == {("calm", "enforce")}
    assert sum(seconds for _, seconds in held) == pytest.approx(2.8, abs=0.01)


async def test_an_observed_quota_holds_nothing_and_counts_what_it_would(
        autojump_clock: trio.testing.MockClock) -> None:
    policy, outcomes, held = policy_of(REQUESTS_QUOTA + "  mode: observe\n")
    async with proxied(echo_handler, policy=policy) as h:
        for i in range(20):
            await h.client.send(request(3, 12, i).encode())
            assert await h.client.receive() is not None
        assert trio.current_time() < 0.01
    assert len(throttles(outcomes)) == 14
    assert set(throttles(outcomes)) == {("calm", "observe")}
    assert held == []


async def test_produce_bytes_are_spent_by_the_requests_size(
        autojump_clock: trio.testing.MockClock) -> None:
    size = len(produce_wire(1))
    policy, outcomes, _ = policy_of(f"- name: writes\n  quota: {{produce_bytes_per_second: "
                                    f"{2 * size}}}\n")  # two requests a second
    async with proxied(produce_answer, policy=policy) as h:
        for i in range(6):
            await h.client.send_raw(produce_wire(i))
            assert await h.client.receive() is not None
            if i == 2:  # a second's worth at once, and one more on credit
                assert trio.current_time() < 0.01
        # The three past those, at two a second: 1.5 s.
        assert trio.current_time() == pytest.approx(1.5, abs=0.01)
        # The debt holds back whatever comes next (a broker mutes the channel): the
        # Metadata request waits for the last Produce request's half second, no more.
        start = trio.current_time()
        await h.client.send(request(3, 12, 99).encode())
        assert await h.client.receive() is not None
        assert trio.current_time() - start == pytest.approx(0.5, abs=0.01)
    assert len(throttles(outcomes)) == 4
    assert {rule for rule, _ in throttles(outcomes)} == {"writes"}


def fetch_broker(times: list[float]) -> Any:
    """A broker that answers each Fetch request with 1 MiB of records, noting when it
    got each."""
    def answer(req: codecs.Request) -> Any:
        times.append(trio.current_time())
        return fetch_answer(req.correlation_id)[4:]

    return answer


async def send_fetch(h: Any, correlation_id: int) -> None:
    await h.client.send(request(1, 17, correlation_id, max_wait_ms=0, min_bytes=1,
                                max_bytes=50 << 20, topics=[]).encode())
    assert await h.client.receive() is not None


async def test_fetch_answers_spend_and_the_next_fetch_waits(
        autojump_clock: trio.testing.MockClock) -> None:
    rate = len(fetch_answer(1)) // 4  # an answer is four seconds' worth
    policy, outcomes, held = policy_of(f"- name: reads\n  quota: {{fetch_bytes_per_second: "
                                       f"{rate}}}\n")
    times: list[float] = []
    async with proxied(fetch_broker(times), policy=policy) as h:
        for i in range(3):
            await send_fetch(h, i)
    # The first answer left a debt of three seconds (past a second's burst), the second
    # one of four.
    assert times == [pytest.approx(0.0, abs=0.01), pytest.approx(3.0, abs=0.01),
                     pytest.approx(7.0, abs=0.01)]
    assert len(throttles(outcomes)) == 2
    assert sum(seconds for _, seconds in held) == pytest.approx(7.0, abs=0.01)


def share_fetch_broker(times: list[float]) -> Any:
    """A broker that answers each ShareFetch request (KIP-932) with 1 MiB of records and
    a throttle of its own of 0, noting when it got each."""
    def answer(req: codecs.Request) -> Any:
        times.append(trio.current_time())
        return response_body(78, 1, throttle_time_ms=0, error_code=0,
                             acquisition_lock_timeout_ms=30000, responses=[
                                 {"topic_id": "00000000-0000-0000-0000-000000000007",
                                  "partitions": [{"partition_index": 0, "records": RECORDS,
                                                  "current_leader": {"leader_id": 1,
                                                                     "leader_epoch": 0},
                                                  "acquired_records": []}]}])

    return answer


async def test_share_fetch_answers_spend_from_the_fetch_quota_and_say_so(
        autojump_clock: trio.testing.MockClock) -> None:
    """A share consumer reads under the same fetch quota as a consumer: its answers spend,
    its next request waits, and each answer asks it to wait (throttle_time_ms)."""
    rate = len(RECORDS) // 4  # an answer is about four seconds' worth
    policy, outcomes, _ = policy_of(f"- name: reads\n  quota: {{fetch_bytes_per_second: "
                                    f"{rate}}}\n")
    times: list[float] = []
    throttled: list[int] = []
    async with proxied(share_fetch_broker(times), policy=policy) as h:
        for i in range(3):
            await h.client.send(request(78, 1, i, group_id="workers", member_id="m",
                                        share_session_epoch=0, max_wait_ms=0, min_bytes=1,
                                        max_bytes=50 << 20, max_records=500, batch_size=500,
                                        topics=[], forgotten_topics_data=[]).encode())
            answer = await h.client.receive()
            assert answer is not None
            throttled.append(codecs.decode_response(answer, 78, 1).body.throttle_time_ms)
    assert times[0] == pytest.approx(0.0, abs=0.01)
    assert times[1] == pytest.approx(3.0, abs=0.05) and times[2] == pytest.approx(7.0, abs=0.05)
    assert all(t >= 2900 for t in throttled), throttled
    assert len(throttles(outcomes)) == 2


async def test_one_enormous_answer_holds_the_client_ten_seconds_at_most(
        autojump_clock: trio.testing.MockClock) -> None:
    policy, _, _ = policy_of("- name: reads\n  quota: {fetch_bytes_per_second: 1000}\n")
    times: list[float] = []
    async with proxied(fetch_broker(times), policy=policy) as h:
        for i in range(2):  # 1 MiB answers: 1,000 s of the rate each
            await send_fetch(h, i)
    assert times == [pytest.approx(0.0, abs=0.01), pytest.approx(MAX_HOLD, abs=0.01)]


async def test_connections_in_one_scope_share_the_budget(
        autojump_clock: trio.testing.MockClock) -> None:
    policy, _, _ = policy_of("- name: team\n  quota: {requests_per_second: 5, "
                             "per: client_id}\n")
    async with proxied(echo_handler, policy=policy) as first, \
            proxied(echo_handler, policy=policy) as second:
        for i in range(10):  # 20 requests with one client id: as 20 on one connection
            for h in (first, second):
                await h.client.send(request(3, 12, i).encode())
                assert await h.client.receive() is not None
        assert trio.current_time() == pytest.approx(2.8, abs=0.01)


async def test_a_quota_for_others_costs_nothing(
        autojump_clock: trio.testing.MockClock) -> None:
    policy, outcomes, _ = policy_of("- name: others\n  match: {client_id: '^other$'}\n"
                                    "  quota: {requests_per_second: 1}\n")
    async with proxied(echo_handler, policy=policy) as h:
        for i in range(20):
            await h.client.send(request(3, 12, i).encode())
            assert await h.client.receive() is not None
        assert trio.current_time() < 0.01
    assert throttles(outcomes) == []


class Decisions(Observer):
    def __init__(self) -> None:
        self.requests = 0

    def request(self, conn: ConnectionInfo, req: codecs.Request, size: int) -> None:
        self.requests += 1


async def test_a_large_produce_request_under_a_quota_is_held_and_counted_once(
        autojump_clock: trio.testing.MockClock) -> None:
    wire = produce_wire(1)  # 1 MiB of records: sent on as it arrives without quotas
    policy, outcomes, _ = policy_of(f"- name: writes\n  quota: {{produce_bytes_per_second: "
                                    f"{len(wire)}}}\n")
    seen = Decisions()
    async with proxied(produce_answer, policy=policy, observer=seen) as h:
        for i in range(3):
            await h.client.send_raw(produce_wire(i))
            assert await h.client.receive() is not None
        # A second's worth, one more on credit, then one a second.
        assert trio.current_time() == pytest.approx(1.0, abs=0.01)
    assert seen.requests == 3
    assert len(throttles(outcomes)) == 1


async def test_two_quotas_in_debt_each_count_their_own_wait(
        autojump_clock: trio.testing.MockClock) -> None:
    size = len(produce_wire(1))
    policy, outcomes, held = policy_of(
        "- name: calls\n  quota: {requests_per_second: 1, per: connection}\n"
        f"- name: bytes\n  quota: {{produce_bytes_per_second: {size}}}\n"
        "- name: roomy\n  quota: {requests_per_second: 100}\n")
    async with proxied(produce_answer, policy=policy) as h:
        for i in range(6):
            await h.client.send_raw(produce_wire(i))
            assert await h.client.receive() is not None
        # Both a request a second past a burst of one (and one on credit): 4 s.
        assert trio.current_time() == pytest.approx(4.0, abs=0.01)
    rules = [rule for rule, _ in throttles(outcomes)]
    assert (rules.count("calls"), rules.count("bytes"), rules.count("roomy")) == (4, 4, 0)
    for rule in ("calls", "bytes"):
        assert sum(s for r, s in held if r == rule) == pytest.approx(4.0, abs=0.01)
