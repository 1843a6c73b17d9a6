"""The per-connection pumps over trio memory streams (real loopback sockets where their own
paths matter), against an in-process fake broker."""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from gatehouse import codecs
from gatehouse.codecs.scram import SaslCredentials, ScramClient
from gatehouse.proxy.addresses import (
    BrokerAddress,
    address_apis,
    address_tags,
    carries_addresses,
    rewrite_addresses,
)
from gatehouse.proxy.config import Limits
from gatehouse.proxy.connection import ConnectionContext, ProxyConnection
from gatehouse.proxy.hooks import (
    Close,
    ConnectionInfo,
    Forward,
    Observer,
    Pending,
    Policy,
    Respond,
)
from gatehouse.proxy.sasl import SaslUsers
from tests.support.fakebroker import (
    FakeBroker,
    FrameStream,
    frame_bytes,
    request,
    response_body,
    tcp_pair,
)
from tests.support.protowire import nested


@dataclass
class Harness:
    client: FrameStream
    broker: FakeBroker
    conn: ConnectionInfo
    pumps: ProxyConnection
    seen: list[BrokerAddress] = field(default_factory=list)
    done: trio.Event = field(default_factory=trio.Event)


class Recorder(Observer):
    def __init__(self) -> None:
        self.requests: list[tuple[int, int]] = []
        self.responses: list[int] = []
        self.sizes: list[int] = []
        self.malformed_errors: list[str] = []

    def request(self, conn: ConnectionInfo, req: codecs.Request, size: int) -> None:
        self.requests.append((req.api_key, req.api_version))

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        self.responses.append(pending.correlation_id)
        self.sizes.append(size)

    def malformed(self, conn: ConnectionInfo, direction: str, error: str) -> None:
        self.malformed_errors.append(f"{direction}: {error}")


@asynccontextmanager
async def proxied(
    handler: Callable[[codecs.Request], Any],
    *,
    policy: Policy | None = None,
    limits: Limits | None = None,
    lockstep: bool = False,
    observer: Observer | None = None,
    draining: trio.Event | None = None,
    upstream: Callable[[trio.abc.Stream], trio.abc.Stream] = lambda stream: stream,
    tcp: bool = False,
    oauthbearer_claim: str = "sub",
    sasl_users: SaslUsers | None = None,
    sasl_session_lifetime: float | None = None,
    upstream_session: float | None = None,
    upstream_credentials: SaslCredentials | None = None,
    client_telemetry: Any = None,
) -> AsyncIterator[Harness]:
    """The pumps of one connection between a test's client and a fake broker, over
    memory streams (lock-step ones with ``lockstep``) or, with ``tcp``, real loopback
    sockets (the proxy's direct socket paths: FastStream's, splice)."""
    client_side: trio.abc.Stream
    proxy_client_side: trio.abc.Stream
    proxy_upstream_side: trio.abc.Stream
    broker_side: trio.abc.Stream
    if tcp:
        client_side, proxy_client_side = await tcp_pair()
        proxy_upstream_side, broker_side = await tcp_pair()
    else:
        pair = trio.testing.lockstep_stream_pair if lockstep else trio.testing.memory_stream_pair
        client_side, proxy_client_side = pair()
        proxy_upstream_side, broker_side = pair()
    proxy_upstream_side = upstream(proxy_upstream_side)
    seen: list[BrokerAddress] = []

    async def brokers_seen(addresses: Any) -> None:
        seen.extend(addresses)

    ctx = ConnectionContext(
        limits=limits or Limits(),
        observer=observer or Observer(),
        address_mapper=lambda real: ("proxy.example", 19000 + real.node_id),
        brokers_seen=brokers_seen,
        draining=draining if draining is not None else trio.Event(),
        get_policy=lambda: policy or Policy(),
        oauthbearer_claim=oauthbearer_claim,
        sasl_users=sasl_users,
        sasl_mechanisms=("SCRAM-SHA-256", "PLAIN") if sasl_users is not None else (),
        upstream_credentials=upstream_credentials,
        sasl_session_lifetime=sasl_session_lifetime,
        client_telemetry=client_telemetry,
    )
    conn = ConnectionInfo(id=1, client="127.0.0.1:5555", listener="bootstrap",
                          upstream="broker:9092")
    pumps = ProxyConnection(proxy_client_side, proxy_upstream_side, conn, ctx,
                            upstream_session)
    broker = FakeBroker(broker_side, handler)
    harness = Harness(FrameStream(client_side), broker, conn, pumps, seen)
    async with trio.open_nursery() as nursery:

        async def run_pumps() -> None:
            await pumps.run()
            harness.done.set()

        nursery.start_soon(run_pumps)
        nursery.start_soon(broker.serve)
        yield harness
        nursery.cancel_scope.cancel()


def echo_handler(req: codecs.Request) -> Any:
    if req.api_key == 18:
        return response_body(18, req.api_version, api_keys=[
            {"api_key": 0, "min_version": 0, "max_version": 11},
            {"api_key": 3, "min_version": 0, "max_version": 12},
            {"api_key": 18, "min_version": 0, "max_version": 4},
        ])
    if req.api_key == 0 and req.body.acks == 0:
        return None
    return req.api.response.root.default


async def test_pipelined_requests_answered_in_order_with_original_bytes() -> None:
    async with proxied(echo_handler) as h:
        sent = [request(3, 12, 100 + i, topics=[]) for i in range(3)]
        for req in sent:  # all three before reading anything: pipelined
            await h.client.send(req.encode())
        got = [await h.client.receive() for _ in sent]
        assert [struct.unpack_from(">i", g)[0] for g in got] == [100, 101, 102]
        # The broker received exactly the client's bytes.
        assert h.broker.received == [bytes(r.encode()) for r in sent]


async def test_acks_zero_produce_gets_no_pending_entry() -> None:
    async with proxied(echo_handler) as h:
        fire_and_forget = request(0, 9, 7, acks=0, timeout_ms=100, topic_data=[])
        await h.client.send(fire_and_forget.encode())
        await h.client.send(request(3, 12, 8, topics=[]).encode())
        answer = await h.client.receive()
        assert answer is not None and struct.unpack_from(">i", answer)[0] == 8
        assert len(h.broker.received) == 2
        assert h.pumps.in_flight == 0


@pytest.mark.parametrize("version", [0, 4, 9, 12, 13])
async def test_metadata_brokers_rewritten_to_proxy_addresses(version: int) -> None:
    def handler(req: codecs.Request) -> Any:
        return response_body(3, req.api_version, brokers=[
            {"node_id": 1, "host": "kafka-1.internal", "port": 9092},
            {"node_id": 2, "host": "kafka-2.internal", "port": 9093},
        ])

    async with proxied(handler) as h:
        await h.client.send(request(3, version, 5).encode())
        frame = await h.client.receive()
        resp = codecs.decode_response(frame, 3, version)
        assert [(b.node_id, b.host, b.port) for b in resp.body.brokers] == [
            (1, "proxy.example", 19001), (2, "proxy.example", 19002)]
        assert [(s.node_id, s.host, s.port) for s in h.seen] == [
            (1, "kafka-1.internal", 9092), (2, "kafka-2.internal", 9093)]


async def test_find_coordinator_v0_and_v4_rewritten() -> None:
    def handler(req: codecs.Request) -> Any:
        if req.api_version < 4:
            return response_body(10, req.api_version, node_id=3, host="k3", port=1)
        return response_body(10, req.api_version, coordinators=[
            {"key": "g", "node_id": 3, "host": "k3", "port": 1},
            {"key": "bad", "node_id": -1, "host": "", "port": -1, "error_code": 15}])

    async with proxied(handler) as h:
        await h.client.send(request(10, 2, 1, key="g").encode())
        old = codecs.decode_response(await h.client.receive(), 10, 2).body
        assert (old.host, old.port) == ("proxy.example", 19003)
        await h.client.send(request(10, 6, 2, coordinator_keys=["g", "bad"]).encode())
        new = codecs.decode_response(await h.client.receive(), 10, 6).body
        assert [(c.host, c.port) for c in new.coordinators] == [("proxy.example", 19003), ("", -1)]


def test_address_apis_found_from_tables() -> None:
    names = {codecs.api(k).name for k in address_apis()}
    assert {"Metadata", "FindCoordinator", "DescribeCluster", "Produce", "Fetch",
            "ShareFetch", "ShareAcknowledge"} <= names
    # Raft (controller-only) and Streams application endpoints are not broker addresses.
    assert not names & {"Vote", "BeginQuorumEpoch", "FetchSnapshot", "StreamsGroupHeartbeat"}



ADDRESS_VERSIONS = [(k, v) for k in sorted(address_apis()) for v in codecs.api(k).versions
                    if carries_addresses(k, v)]


@pytest.mark.parametrize(("api_key", "version"), ADDRESS_VERSIONS)
def test_every_broker_address_in_every_answer_is_rewritten(api_key: int, version: int) -> None:
    """Every response version that can hold a broker's address, random bodies with the
    broker's host in every host field and node ids of brokers: after the rewrite no
    answer holds the broker's host (a client never learns a way around the proxy)."""
    from hypothesis import HealthCheck, Phase, given, settings

    from gatehouse.codecs.walk import rewrite
    from tests.codec_strategies import message_body

    api = codecs.api(api_key)

    def brokers_everywhere(body: Any) -> Any:
        def visit(struct: Any, record: Any) -> Any:
            changes: dict[str, Any] = {"host": "broker.internal"}
            for attr in ("node_id", "broker_id"):
                if getattr(record, attr, None) is not None:
                    changes[attr] = abs(getattr(record, attr)) % 1000
            return record.replace(**changes)

        return rewrite(api.response, version, body, lambda f: f.attr == "host", visit)

    @settings(max_examples=3, deadline=None, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(message_body(api.response, version))
    def check(body: Any) -> None:
        resp = codecs.Response.build(api_key, version, 1, brokers_everywhere(body))
        shown, seen = rewrite_addresses(resp, lambda b: ("proxy.example", 19000 + b.node_id))
        assert b"broker.internal" not in bytes(shown.encode())
        assert all(b.host == "broker.internal" for b in seen)

    check()


@pytest.mark.parametrize("version", list(codecs.api("DescribeConfigs").versions))
def test_a_brokers_advertised_listeners_in_describe_configs_name_the_proxy(
        version: int) -> None:
    """DescribeConfigs of a broker: advertised.listeners (and its synonyms, v1+) is where
    its clients connect; through the proxy, every listener in it is the proxy's address
    for that broker.  Other configs, other resources and the cluster-wide defaults are
    left as they are; nothing is learnt from it."""
    api = codecs.api("DescribeConfigs")
    structs = api.response.structs
    Result, Config = structs["DescribeConfigsResult"].cls, structs["DescribeConfigsResourceResult"].cls
    Synonym = structs["DescribeConfigsSynonym"].cls
    listeners = "PLAINTEXT://kafka-2.internal:9092,SSL://[fd00::2]:9093"

    def config(name: str, value: str | None) -> Any:
        synonyms = (Synonym(name=name, value=value, source=2),) if version >= 1 else ()
        return Config(name=name, value=value, read_only=True, is_default=False,
                      config_source=4, is_sensitive=False, synonyms=synonyms,
                      config_type=0, documentation=None)

    def result(kind: int, name: str, *configs: Any) -> Any:
        return Result(error_code=0, error_message=None, resource_type=kind,
                      resource_name=name, configs=configs)

    body = api.response.root.cls(throttle_time_ms=0, results=(
        result(4, "2", config("advertised.listeners", listeners),
               config("listeners", "PLAINTEXT://0.0.0.0:9092"), config("log.dirs", "/k")),
        result(4, "", config("advertised.listeners", listeners)),  # the defaults: no node
        result(2, "orders", config("advertised.listeners", listeners)),  # a topic's
    ))
    resp = codecs.Response.build(api.key, version, 7, body)
    assert carries_addresses(api.key, version)
    shown, seen = rewrite_addresses(resp, lambda b: ("proxy.example", 19000 + b.node_id))
    assert seen == []
    shown = codecs.decode_response(bytes(shown.encode()), api.key, version)
    broker, defaults, topic = shown.body.results
    advertised, bind, dirs = broker.configs
    assert advertised.value == "PLAINTEXT://proxy.example:19002,SSL://proxy.example:19002"
    if version >= 1:
        assert advertised.synonyms[0].value == advertised.value
    assert (bind.value, dirs.value) == ("PLAINTEXT://0.0.0.0:9092", "/k")
    assert defaults.configs[0].value == topic.configs[0].value == listeners
    # A broker the proxy has no port for, and a value that is not a listener list: kept.
    kept, _ = rewrite_addresses(resp, lambda b: None)
    assert kept is resp
    odd = codecs.Response.build(api.key, version, 7, body.replace(results=(
        result(4, "2", config("advertised.listeners", "not a listener")),)))
    assert rewrite_addresses(odd, lambda b: ("proxy.example", 1))[0] is odd


def test_only_versions_with_node_endpoints_are_decoded_for_addresses() -> None:
    assert not carries_addresses(0, 9) and carries_addresses(0, 10)  # Produce (KIP-951)
    assert not carries_addresses(1, 15) and carries_addresses(1, 16)  # Fetch
    assert carries_addresses(3, 0)  # Metadata: always
    assert not carries_addresses(18, 3)  # ApiVersions: never


async def test_responses_that_cannot_carry_addresses_pass_through_undecoded() -> None:
    """A Produce v9 answer is not decoded: even bytes the codec would reject (a trailing
    byte) reach the client unchanged, and the connection stays open."""
    def handler(req: codecs.Request) -> Any:
        if req.api_key != 0:
            return echo_handler(req)
        body = codecs.Response.build(0, 9, req.correlation_id, response_body(0, 9)).encode()
        return bytes(body) + b"\x00"

    async with proxied(handler) as h:
        await h.client.send(request(0, 9, 5, acks=1, timeout_ms=100, topic_data=[]).encode())
        answer = await h.client.receive()
        assert answer is not None and answer.endswith(b"\x00")
        with pytest.raises(codecs.ProtocolError):
            codecs.decode_response(answer, 0, 9).body  # noqa: B018
        await h.client.send(request(3, 12, 6, topics=[]).encode())
        assert await h.client.receive() is not None
        assert h.pumps.close_reason == "client closed"
async def test_produce_v10_node_endpoints_rewritten() -> None:
    def handler(req: codecs.Request) -> Any:
        return response_body(0, req.api_version, node_endpoints=[
            {"node_id": 2, "host": "k2", "port": 9092, "rack": None}])

    async with proxied(handler) as h:
        await h.client.send(request(0, 11, 1, acks=-1, timeout_ms=100, topic_data=[]).encode())
        body = codecs.decode_response(await h.client.receive(), 0, 11).body
        assert [(e.host, e.port) for e in body.node_endpoints] == [("proxy.example", 19002)]


def test_address_tags_only_where_top_level_tags_alone_carry_addresses() -> None:
    assert address_tags(0, 10) == address_tags(1, 16) == frozenset({0})  # NodeEndpoints
    assert address_tags(3, 12) is None  # Metadata's brokers are not tagged
    assert address_tags(10, 3) is None  # FindCoordinator v0-3: the root itself


class ScanRecorder(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[Any, Any]] = []

    def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                 frame: Any = None) -> None:
        self.seen.append((pending.decoded, pending.scan))


@pytest.mark.parametrize("version", [10, 12, 13])
async def test_produce_responses_without_node_endpoints_are_read_not_decoded(
        version: int) -> None:
    """Produce v10+ responses are scanned for their top-level tags: without NodeEndpoints
    the very bytes go through undecoded and the observers get the scan's error codes;
    with them it is decoded and rewritten (test_produce_v10_node_endpoints_rewritten)."""
    topic = ({"topic_id": "00000000-0000-0000-0000-0000000000aa"} if version >= 13
             else {"name": "t"})

    def handler(req: codecs.Request) -> Any:
        if req.api_key != 0:
            return echo_handler(req)
        body = response_body(0, version, responses=[{**topic, "partition_responses": [
            {"index": 0, "error_code": 0}, {"index": 1, "error_code": 6}]}])
        return bytes(codecs.Response.build(0, version, req.correlation_id, body).encode())

    recorder = ScanRecorder()
    async with proxied(handler, observer=recorder) as h:
        await h.client.send(request(0, version, 1, acks=-1, timeout_ms=100,
                                    topic_data=[]).encode())
        answer = await h.client.receive()
        assert answer is not None
        assert codecs.decode_response(answer, 0, version).body.responses[0] \
            .partition_responses[1].error_code == 6
    [(decoded, scan)] = recorder.seen
    assert decoded is None and scan == ({0: 1, 6: 1}, (), False)


class ReadsProduceAnswers(Policy):
    """Wants every Produce answer, as a topic rename does; keeps what it was given."""

    def __init__(self) -> None:
        self.given: list[codecs.Response] = []

    def on_request(self, conn: ConnectionInfo, req: codecs.Request) -> Any:
        return Forward(req, wants_response=req.api_key == 0)

    def on_response(self, conn: ConnectionInfo, pending: Pending,
                    resp: codecs.Response) -> codecs.Response:
        self.given.append(resp)
        return resp


@pytest.mark.parametrize("endpoints", [False, True])
async def test_a_produce_answer_a_policy_reads_is_walked_for_addresses_only_if_it_has_some(
        endpoints: bool) -> None:
    """The policy gets the answer undecoded when its bytes name no brokers (the tag scan
    says so), and decoded with the proxy's addresses when they do; the observers then
    read the bytes they get as they would without the policy (the scan), or the answer
    as changed (not a scan of the broker's bytes)."""
    nodes = [{"node_id": 2, "host": "k2", "port": 9092, "rack": None}] if endpoints else []

    def handler(req: codecs.Request) -> Any:
        if req.api_key != 0:
            return echo_handler(req)
        return response_body(0, 12, node_endpoints=nodes)

    policy = ReadsProduceAnswers()
    recorder = ScanRecorder()
    async with proxied(handler, policy=policy, observer=recorder) as h:
        await h.client.send(request(0, 12, 1, acks=-1, timeout_ms=100, topic_data=[]).encode())
        body = codecs.decode_response(await h.client.receive(), 0, 12).body
    [given] = policy.given
    assert given.body_decoded == endpoints
    assert [(e.host, e.port) for e in body.node_endpoints] == (
        [("proxy.example", 19002)] if endpoints else [])
    [(decoded, scan)] = recorder.seen
    if endpoints:
        assert decoded is not None and decoded.body.node_endpoints[0].host == "proxy.example"
        assert scan is None
    else:
        assert decoded is None and scan == ({}, (), False)


async def test_api_versions_capped_and_features_kept() -> None:
    unknown_key = 999
    top = codecs.api(3).versions.hi

    def handler(req: codecs.Request) -> Any:
        return response_body(18, req.api_version, api_keys=[
            {"api_key": 0, "min_version": 0, "max_version": 11},
            {"api_key": 3, "min_version": 0, "max_version": top + 5},
            {"api_key": unknown_key, "min_version": 0, "max_version": 1},
        ], supported_features=[{"name": "transaction.version", "min_version": 0,
                                "max_version": 2}],
            finalized_features_epoch=7,
            finalized_features=[{"name": "transaction.version", "max_version_level": 2,
                                 "min_version_level": 2}])

    async with proxied(handler) as h:
        await h.client.send(request(18, 4, 1, client_software_name="librdkafka",
                                    client_software_version="2.6.0").encode())
        body = codecs.decode_response(await h.client.receive(), 18, 4).body
        ranges = {k.api_key: (k.min_version, k.max_version) for k in body.api_keys}
        assert ranges == {0: (0, 11), 3: (0, top)}  # Produce min stays 0 (KAFKA-18727)
        assert body.finalized_features_epoch == 7
        assert [f.name for f in body.supported_features] == ["transaction.version"]
        assert h.conn.software_name == "librdkafka"
        assert h.conn.software_version == "2.6.0"


async def test_a_capped_api_versions_answer_is_reused_until_the_rules_change() -> None:
    """Every connection starts with ApiVersions and the broker answers the same: the
    capped answer is made once per answer and adjusters, then reused (with each
    request's correlation id); new rules make a new one."""
    from gatehouse.configfile import load_yaml_text
    from gatehouse.proxy.policy import RulesPolicy
    from gatehouse.rules import parse_rules

    top = codecs.api(3).versions.hi

    def handler(req: codecs.Request) -> Any:
        return response_body(18, req.api_version, api_keys=[
            {"api_key": 1, "min_version": 0, "max_version": 17},
            {"api_key": 3, "min_version": 0, "max_version": top + 5}])

    def rules(minimum: int) -> Any:
        text = f"- name: r\n  min_api_version: {{Metadata: {minimum}}}\n"
        return parse_rules(load_yaml_text(text, "rules.yaml"), "rules.yaml")

    policy = RulesPolicy(rules(4))
    calls: list[int] = []
    version_ranges = type(policy.ruleset).version_ranges

    def counted(self: Any, facts: Any, api_key: int, lo: int, hi: int) -> Any:
        calls.append(api_key)
        return version_ranges(self, facts, api_key, lo, hi)

    async def ranges(correlation_id: int) -> dict[int, tuple[int, int]]:
        await h.client.send(request(18, 4, correlation_id).encode())
        resp = codecs.decode_response(await h.client.receive(), 18, 4)
        assert resp.header.correlation_id == correlation_id
        return {k.api_key: (k.min_version, k.max_version) for k in resp.body.api_keys}

    import unittest.mock
    with unittest.mock.patch.object(type(policy.ruleset), "version_ranges", counted):
        async with proxied(handler, policy=policy) as h:
            for correlation_id in (1, 2, 3):
                assert await ranges(correlation_id) == {1: (0, 17), 3: (4, top)}
            assert calls == [1, 3]  # capped once, reused twice
            policy.ruleset = rules(6)
            assert await ranges(4) == {1: (0, 17), 3: (6, top)}
            assert calls == [1, 3, 1, 3]


async def test_api_versions_adjusters_that_cannot_be_a_key_still_apply() -> None:
    """A policy whose adjusters cannot be part of a key (unhashable): every answer is
    capped afresh, none is kept."""

    class Ceiling:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, api_key: int, lo: int, hi: int) -> tuple[int, int] | None:
            return lo, min(hi, 5)

    class Capping(Policy):
        def api_version_adjusters(self, conn: ConnectionInfo) -> tuple[Any, ...]:
            return (Ceiling(),)

    def handler(req: codecs.Request) -> Any:
        return response_body(18, req.api_version, api_keys=[
            {"api_key": 3, "min_version": 0, "max_version": 12}])

    async with proxied(handler, policy=Capping()) as h:
        for correlation_id in (1, 2):
            await h.client.send(request(18, 4, correlation_id).encode())
            body = codecs.decode_response(await h.client.receive(), 18, 4).body
            assert [(k.api_key, k.max_version) for k in body.api_keys] == [(3, 5)]
        assert h.pumps.ctx.api_versions_answers == {}


async def test_telemetry_requests_are_the_proxys_to_answer_in_their_place_in_line() -> None:
    """metrics.client_telemetry: ApiVersions offers KIP-714's two APIs (this broker has
    no receiver), and the client's GetTelemetrySubscriptions and PushTelemetry are
    answered by the proxy, never sent on, each after the answers owed before it."""
    from gatehouse.metrics.telemetry import READ_IN_THREAD, ClientTelemetry, TelemetrySettings

    telemetry = ClientTelemetry(TelemetrySettings(push_interval=5))
    instance = "6f2b3c1e-0d7a-4c55-9a4e-2b1c3d4e5f60"

    def handler(req: codecs.Request) -> Any:
        if req.api_key == 18:
            return response_body(18, req.api_version, api_keys=[
                {"api_key": 3, "min_version": 0, "max_version": 12},
                {"api_key": 18, "min_version": 0, "max_version": 4}])
        return response_body(3, req.api_version, brokers=[], topics=[])

    async with proxied(handler, client_telemetry=telemetry) as h:
        await h.client.send(request(18, 4, 1, client_software_name="librdkafka",
                                    client_software_version="2.16.0").encode())
        body = codecs.decode_response(await h.client.receive(), 18, 4).body
        assert {k.api_key: (k.min_version, k.max_version) for k in body.api_keys} == {
            3: (0, 12), 18: (0, 4), 71: (0, 0), 72: (0, 0)}
        # Pipelined: Metadata (the broker's), then the two telemetry requests (ours).
        await h.client.send(request(3, 12, 2).encode())
        await h.client.send(request(71, 0, 3, client_instance_id=instance).encode())
        await h.client.send(request(
            72, 0, 4, client_instance_id=instance, subscription_id=telemetry.subscription_id,
            terminating=False, compression_type=0, metrics=b"").encode())
        answers = [await h.client.receive() for _ in range(3)]
        assert [struct.unpack_from(">i", a)[0] for a in answers] == [2, 3, 4]
        subscription = codecs.decode_response(answers[1], 71, 0).body
        assert subscription.push_interval_ms == 5000
        assert codecs.decode_response(answers[2], 72, 0).body.error_code == 0
        # A push large enough to be read in a thread, from another instance: throttled
        # (this connection pushed just now), then, as it closes, taken.
        big = b"".join(  # 3,000 gauges, OTLP written by hand: MetricsData > ... > Metric
            nested(b"\x0a" + bytes([len(name)]) + name + nested(b"\x21" + bytes(8), 5, 1),
                   1, 2, 2) for name in (f"m{i:05}".encode() for i in range(3000)))
        assert len(big) >= READ_IN_THREAD
        for correlation_id, terminating in ((5, False), (6, True)):
            await h.client.send(request(
                72, 0, correlation_id, client_instance_id="00000000-0000-0000-0000-000000000009",
                subscription_id=telemetry.subscription_id, terminating=terminating,
                compression_type=0, metrics=big).encode())
        codes = [codecs.decode_response(await h.client.receive(), 72, 0).body.error_code
                 for _ in range(2)]
        assert codes == [89, 0]  # THROTTLING_QUOTA_EXCEEDED, then taken
        assert telemetry.kept_samples == 3000
        assert [codecs.decode_request_header(f).api_key for f in h.broker.received] == [18, 3]
        assert h.conn.requests == 6


async def test_observed_telemetry_goes_on_to_the_brokers_receiver() -> None:
    """client_telemetry in observe mode: the broker's ApiVersions stand, and a push is
    read on its way to the broker, which answers it."""
    from gatehouse.metrics.telemetry import ClientTelemetry, TelemetrySettings

    telemetry = ClientTelemetry(TelemetrySettings(mode="observe"))
    instance = "00000000-0000-0000-0000-000000000009"
    offered = [{"api_key": 18, "min_version": 0, "max_version": 4},
               {"api_key": 71, "min_version": 0, "max_version": 0},
               {"api_key": 72, "min_version": 0, "max_version": 0}]

    def handler(req: codecs.Request) -> Any:
        if req.api_key == 18:
            return response_body(18, req.api_version, api_keys=offered)
        if req.api_key == 71:
            return response_body(71, 0, error_code=0, client_instance_id=instance,
                                 subscription_id=77, push_interval_ms=600_000,
                                 telemetry_max_bytes=1 << 20, requested_metrics=["g"])
        return response_body(72, 0, error_code=0, throttle_time_ms=7)

    gauge = nested(b"\x0a\x01g" + nested(b"\x21" + bytes(8), 5, 1), 1, 2, 2)
    async with proxied(handler, client_telemetry=telemetry) as h:
        await h.client.send(request(18, 3, 1).encode())
        body = codecs.decode_response(await h.client.receive(), 18, 3).body
        assert sorted(k.api_key for k in body.api_keys) == [18, 71, 72]
        # The broker's subscription gives the client its instance id and interval,
        # which the proxy reads on the way (its answer the broker's very bytes).
        await h.client.send(request(71, 0, 3, client_instance_id=str(uuid.UUID(int=0))
                                    ).encode())
        subscription = codecs.decode_response(await h.client.receive(), 71, 0).body
        assert subscription.push_interval_ms == 600_000
        assert telemetry.intervals == {uuid.UUID(instance): 600.0}
        await h.client.send(request(
            72, 0, 2, client_instance_id=instance,
            subscription_id=77, terminating=False, compression_type=0,
            metrics=gauge).encode())
        answer = codecs.decode_response(await h.client.receive(), 72, 0).body
        assert answer.throttle_time_ms == 7  # the broker's answer
        assert [codecs.decode_request_header(f).api_key for f in h.broker.received] == [
            18, 71, 72]
        assert telemetry.kept_samples == 1


async def test_api_versions_unsupported_version_answered_in_v0_format() -> None:
    # A broker that does not know ApiVersions v4 answers error 35 in the v0 layout.
    v0_body = response_body(18, 0, error_code=35, api_keys=[
        {"api_key": 18, "min_version": 0, "max_version": 3}])
    raw = codecs.Response.build(18, 0, 9, v0_body).encode()

    async with proxied(lambda req: raw) as h:
        await h.client.send(request(18, 4, 9).encode())
        frame = await h.client.receive()
        assert frame == bytes(raw)  # nothing to cap: passes through intact
        resp = codecs.decode_response(frame, 18, 4)
        assert resp.body.error_code == 35
        assert [(k.api_key, k.max_version) for k in resp.body.api_keys] == [(18, 3)]


async def test_unknown_api_key_forwarded_untouched() -> None:
    weird_request = struct.pack(">hhi", 250, 3, 77) + struct.pack(">h", 1) + b"c" + b"\x01\x02"
    weird_answer = struct.pack(">i", 77) + b"\xde\xad"
    async with proxied(lambda req: weird_answer) as h:
        await h.client.send(weird_request)
        assert await h.client.receive() == weird_answer
        assert h.broker.received == [weird_request]


async def test_garbage_from_client_closes_connection_with_a_reason() -> None:
    recorder = Recorder()
    async with proxied(echo_handler, observer=recorder) as h:
        await h.client.send(b"\x00\x01")  # shorter than a request header
        await h.done.wait()
        assert "malformed request from client" in h.pumps.close_reason
        assert await h.client.receive() is None
        assert recorder.malformed_errors


async def test_two_gib_frame_refused_before_buffering() -> None:
    async with proxied(echo_handler) as h:
        await h.client.send_raw(struct.pack(">i", 0x7FFFFFFF) + b"x" * 10)
        await h.done.wait()
        assert "frame size" in h.pumps.close_reason
        assert h.broker.received == []


@pytest.mark.parametrize("tcp", [False, True])
async def test_a_whole_frame_in_one_read_still_meets_the_size_limit(tcp: bool) -> None:
    # Over TCP a frame that arrives whole in one read is handed on as it came (no
    # reader): one of max_frame_bytes goes up byte for byte, one a byte larger is
    # refused, as through the reader (memory streams).
    limit = 4096
    fits = request(3, 12, 5, topics=[])
    fits_bytes = bytes(fits.encode())
    padded = fits_bytes + b"\x00" * (limit - len(fits_bytes))  # the broker ignores a tail
    async with proxied(echo_handler, limits=Limits(max_frame_bytes=limit), tcp=tcp) as h:
        await h.client.send_raw(struct.pack(">i", limit) + padded)
        got = await h.client.receive()
        assert got is not None and struct.unpack_from(">i", got)[0] == 5
        assert h.broker.received == [padded]
        await h.client.send_raw(struct.pack(">i", limit + 1) + padded + b"\x00")
        with trio.move_on_after(10):  # a frame let through would be answered instead
            await h.done.wait()
        assert f"frame size {limit + 1} is outside" in h.pumps.close_reason
        assert h.broker.received == [padded]


async def test_client_disconnect_mid_frame() -> None:
    async with proxied(echo_handler) as h:
        await h.client.send_raw(struct.pack(">i", 100) + b"partial")
        await h.client.stream.aclose()
        await h.done.wait()
        assert "middle of a frame" in h.pumps.close_reason
        assert h.broker.received == []


async def test_broker_out_of_step_correlation_closes() -> None:
    def handler(req: codecs.Request) -> Any:
        return codecs.Response.build(3, req.api_version, req.correlation_id + 1,
                                     req.api.response.root.default)

    async with proxied(handler) as h:
        await h.client.send(request(3, 12, 1).encode())
        await h.done.wait()
        assert "out of step" in h.pumps.close_reason


async def test_broker_closing_closes_the_client() -> None:
    async with proxied(lambda req: None) as h:
        await h.client.send(request(3, 12, 1).encode())
        while not h.broker.received:
            await trio.testing.wait_all_tasks_blocked()
        await h.broker.frames.stream.aclose()
        await h.done.wait()
        assert "closed the connection with 1 request(s) in flight" in h.pumps.close_reason
        assert await h.client.receive() is None


async def test_sasl_handshake_v0_raw_tokens_pass_through() -> None:
    def handler(req: codecs.Request) -> Any:
        if req.api_key == 17:
            broker.raw_mode = 2  # SCRAM: two raw tokens follow
            return response_body(17, 0, mechanisms=["SCRAM-SHA-256"])
        return echo_handler(req)

    async with proxied(handler) as h:
        broker = h.broker
        await h.client.send(request(17, 0, 1, mechanism="SCRAM-SHA-256").encode())
        await h.client.receive()
        for token in (b"n,,n=user,r=abc", b"c=biws,r=abcdef,p=xyz"):
            await h.client.send(token)
            assert await h.client.receive() == b"raw-answer:" + token
        # Back to Kafka framing after the exchange.
        await h.client.send(request(3, 1, 5).encode())
        assert struct.unpack_from(">i", await h.client.receive())[0] == 5
        # The broker's last answer is no SCRAM server-final message: no principal.
        assert h.conn.principal is None


async def test_a_raw_plain_exchange_the_broker_answers_names_the_principal() -> None:
    """SaslHandshake v0 then one raw PLAIN token: a broker that answers it (rather than
    closing the connection) accepted the user the token names."""
    def handler(req: codecs.Request) -> Any:
        if req.api_key == 17:
            broker.raw_mode = 1
            return response_body(17, 0, mechanisms=["PLAIN"])
        return echo_handler(req)

    recorder = Recorder()
    async with proxied(handler, observer=recorder) as h:
        broker = h.broker
        await h.client.send(request(17, 0, 1, mechanism="PLAIN").encode())
        await h.client.receive()
        await h.client.send(b"\0alice\0secret")
        assert await h.client.receive() == b"raw-answer:\0alice\0secret"
        assert h.conn.principal == "alice"
        assert recorder.responses == [1, -1]  # the raw answer is heard (the census)


class RefuseMetadata(Policy):
    def on_request(self, conn: ConnectionInfo, req: codecs.Request) -> Any:
        if req.api_key == 3:
            body = req.api.response.root.default
            return Respond(codecs.Response.build(3, req.api_version, req.correlation_id, body))
        return Forward(req)


async def test_local_answers_keep_their_place_in_line() -> None:
    release = trio.Event()
    answers: list[codecs.Request] = []

    def handler(req: codecs.Request) -> Any:
        answers.append(req)
        return None  # answered below, once released

    async with proxied(handler, policy=RefuseMetadata()) as h:
        await h.client.send(request(10, 2, 1, key="g").encode())  # forwarded
        await h.client.send(request(3, 12, 2).encode())  # answered by the proxy
        while not answers:
            await trio.testing.wait_all_tasks_blocked()
        release.set()
        first = answers[0]
        await h.broker.frames.send(codecs.Response.build(
            10, 2, first.correlation_id, first.api.response.root.default).encode())
        ids = [struct.unpack_from(">i", await h.client.receive())[0] for _ in range(2)]
        assert ids == [1, 2]  # the local answer did not overtake the forwarded one
        assert h.conn.refused == 1


class EndsAtAcks0Produce(Policy):
    """Sends every request on but an acks=0 Produce, which it sends and then closes the
    connection after (``close_after``: some of its partitions refused), refuses with an
    answer (``Respond``: no answer can carry it) or refuses closing (``Close``)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def on_request(self, conn: ConnectionInfo, req: codecs.Request) -> Any:
        if req.api_key != 0:
            return Forward(req)
        if self.how == "close_after":
            return Forward(req, close_after="closed after a Produce")
        if self.how == "respond":
            return Respond(codecs.Response.build(0, req.api_version, req.correlation_id,
                                                 req.api.response.root.default))
        return Close("closed at a Produce")


@pytest.mark.parametrize(("how", "sent", "reason"), [
    ("close_after", [3, 0], "closed after a Produce"),
    ("respond", [3], "refused a Produce request with acks=0 (no response possible)"),
    ("close", [3], "closed at a Produce"),
])
async def test_an_acks_0_request_ending_the_connection_lets_the_answers_owed_out_first(
        how: str, sent: list[int], reason: str) -> None:
    """The answers owed for earlier requests reach the client, then the connection
    closes with the policy's reason (a broker owes none when it closes: it reads a
    connection's next request once it has answered)."""
    held: list[codecs.Request] = []
    async with proxied(lambda req: held.append(req) if req.api_key == 3 else None,
                       policy=EndsAtAcks0Produce(how)) as h:
        await h.client.send(request(3, 12, 1).encode())  # answered later
        await h.client.send(request(0, 9, 2, acks=0, timeout_ms=1000, topic_data=[]).encode())
        while not held or h.pumps.close_reason != reason:
            await trio.testing.wait_all_tasks_blocked()
        assert [codecs.decode_request(r).api_key for r in h.broker.received] == sent
        await answer_held(h, held[0])  # the Metadata answer still came down
        await h.done.wait()
        assert await h.client.receive() is None  # then the connection closed
        assert h.pumps.close_reason == reason
        assert h.conn.refused == 1


async def test_backpressure_bounds_requests_in_flight() -> None:
    limits = Limits(max_in_flight=4)
    async with proxied(echo_handler, limits=limits, lockstep=True) as h:
        async with trio.open_nursery() as nursery:

            async def flood() -> None:
                for i in range(50):
                    await h.client.send(request(3, 12, i).encode())

            nursery.start_soon(flood)
            await trio.testing.wait_all_tasks_blocked()
            # The client reads nothing: the proxy stops reading it after a few requests.
            assert len(h.broker.received) <= limits.max_in_flight + 2
            for _ in range(50):
                assert await h.client.receive() is not None
        assert len(h.broker.received) == 50


async def test_idle_connection_times_out(autojump_clock: trio.testing.MockClock) -> None:
    async with proxied(echo_handler, limits=Limits(idle_timeout=30)) as h:
        await h.client.send(request(3, 12, 1).encode())
        await h.client.receive()
        await h.done.wait()
        assert h.pumps.close_reason == "idle timeout"
        assert trio.current_time() >= 30



async def test_requests_keep_a_connection_alive_past_the_idle_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    async with proxied(echo_handler, limits=Limits(idle_timeout=30)) as h:
        for i in range(5):  # one request every 20 s: 100 s in all, never 30 s idle
            await trio.sleep(20)
            await h.client.send(request(3, 12, i).encode())
            assert await h.client.receive() is not None
        last = trio.current_time()
        await h.done.wait()
        assert h.pumps.close_reason == "idle timeout"
        assert last + 30 <= trio.current_time() <= last + 31
async def answer_held(h: Harness, req: codecs.Request) -> None:
    """The fake broker answers ``req``, a Metadata request it held; the client gets it."""
    resp = codecs.Response.build(3, 12, req.correlation_id, req.api.response.root.default)
    await h.broker.frames.send(resp.encode())
    assert struct.unpack_from(">i", await h.client.receive())[0] == req.correlation_id


async def test_draining_finishes_in_flight_then_closes() -> None:
    draining = trio.Event()
    held: list[codecs.Request] = []
    async with proxied(lambda req: held.append(req), draining=draining) as h:
        await h.client.send(request(3, 12, 42).encode())
        while not held:
            await trio.testing.wait_all_tasks_blocked()
        draining.set()
        await trio.testing.wait_all_tasks_blocked()
        await answer_held(h, held[0])
        await h.done.wait()
        assert h.pumps.close_reason == "proxy shutting down"


async def test_an_old_connection_answers_what_it_took_then_closes(
        autojump_clock: trio.testing.MockClock) -> None:
    """``limits.max_connection_age``: at 60 s (+-10%) it takes no new request, answers the
    one in flight and closes; the close is a clean one."""
    held: list[codecs.Request] = []
    async with proxied(lambda req: held.append(req),
                       limits=Limits(max_connection_age=60.0)) as h:
        await h.client.send(request(3, 12, 7).encode())
        while not held:
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(70)  # past the age: the request is still owed its answer
        assert not h.done.is_set()
        await h.client.send(request(3, 12, 8).encode())  # not taken any more
        await trio.testing.wait_all_tasks_blocked()
        await answer_held(h, held[0])
        await h.done.wait()
        assert h.pumps.close_reason == "connection age limit reached"
        assert 54 <= trio.current_time() <= 71
        assert len(held) == 1


class GatedStream(trio.abc.Stream):
    """An upstream whose sends wait for ``open``: a broker slow to take a request."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.sending = trio.Event()
        self.open = trio.Event()

    async def send_all(self, data: Any) -> None:
        self.sending.set()
        await self.open.wait()
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_draining_while_a_request_goes_up_sends_it_whole_and_answers_it() -> None:
    draining = trio.Event()
    gated: list[GatedStream] = []

    def gate(stream: trio.abc.Stream) -> trio.abc.Stream:
        gated.append(GatedStream(stream))
        return gated[0]

    async with proxied(echo_handler, draining=draining, upstream=gate) as h:
        await h.client.send(request(3, 12, 42).encode())
        await gated[0].sending.wait()  # the client reader is in the middle of sending it
        draining.set()
        await trio.testing.wait_all_tasks_blocked()
        gated[0].open.set()
        assert struct.unpack_from(">i", await h.client.receive())[0] == 42
        await h.done.wait()
        assert h.pumps.close_reason == "proxy shutting down"
        assert len(h.broker.received) == 1


class DrainedAsBytesCome:
    """The client's stream, as the pumps see it, where a drain (an age limit, a shutdown)
    is asked for just as the bytes of request ``correlation_id`` arrive: while the
    receive still counts as waiting, too late to cancel it."""

    def __init__(self, inner: Any, pumps: ProxyConnection, correlation_id: int) -> None:
        self.inner, self.pumps = inner, pumps
        self.marker = struct.pack(">i", correlation_id)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def receive_some(self, max_bytes: int) -> Any:
        data = await self.inner.receive_some(max_bytes)
        if self.marker in bytes(data):
            self.inner.waiting = True
            self.pumps._drain("connection age limit reached")
            self.inner.waiting = False
        return data


async def test_a_drain_that_comes_with_a_requests_bytes_still_forwards_and_answers_it() -> None:
    async with proxied(echo_handler) as h:
        h.pumps.client_io = DrainedAsBytesCome(h.pumps.client_io, h.pumps, 4242)  # type: ignore[assignment]
        await h.client.send(request(3, 12, 1).encode())
        assert struct.unpack_from(">i", await h.client.receive())[0] == 1
        await h.client.send(request(3, 12, 4242).encode())
        with trio.fail_after(5):  # a request owed an answer it never asked for hangs here
            assert struct.unpack_from(">i", await h.client.receive())[0] == 4242
            await h.done.wait()
        assert h.pumps.close_reason == "connection age limit reached"
        assert len(h.broker.received) == 2


async def test_a_drain_stops_a_reader_waiting_on_a_quiet_socket_at_once() -> None:
    # Plain TCP: the reader's one cancel scope, cancelled as it waits with no bytes there.
    async with proxied(echo_handler, tcp=True) as h:
        await h.client.send(request(3, 12, 1).encode())
        assert struct.unpack_from(">i", await h.client.receive())[0] == 1
        await trio.testing.wait_all_tasks_blocked()
        assert h.pumps.client_io.waiting
        h.pumps._drain("connection age limit reached")
        with trio.fail_after(5):
            await h.done.wait()
            assert await h.client.receive() is None
        assert h.pumps.close_reason == "connection age limit reached"


async def test_a_drain_with_a_requests_bytes_waiting_on_the_socket_forwards_and_answers_it(
) -> None:
    # Plain TCP, the reader still waiting when the drain comes though the bytes are there
    # (written without a checkpoint, so it has not run): not cancelled, it takes them.
    async with proxied(echo_handler, tcp=True) as h:
        await h.client.send(request(3, 12, 1).encode())
        assert struct.unpack_from(">i", await h.client.receive())[0] == 1
        await trio.testing.wait_all_tasks_blocked()
        assert h.pumps.client_io.waiting
        data = frame_bytes(request(3, 12, 4242).encode())
        client_fd = h.client.stream.socket.fileno()  # type: ignore[attr-defined]
        assert os.write(client_fd, data) == len(data)  # no checkpoint: the reader waits on
        h.pumps._drain("connection age limit reached")
        with trio.fail_after(5):
            assert struct.unpack_from(">i", await h.client.receive())[0] == 4242
            await h.done.wait()
        assert h.pumps.close_reason == "connection age limit reached"
        assert len(h.broker.received) == 2


async def test_local_answers_between_forwarded_ones_keep_their_places() -> None:
    held: list[codecs.Request] = []

    async with proxied(lambda req: held.append(req), policy=RefuseMetadata()) as h:
        for correlation_id, key in enumerate((10, 3, 10, 3, 3), start=1):
            if key == 10:
                await h.client.send(request(10, 2, correlation_id, key="g").encode())
            else:  # answered by the proxy
                await h.client.send(request(3, 12, correlation_id).encode())
        while len(held) < 2:
            await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()
        assert h.pumps.in_flight == 2 and len(h.pumps.line) == 5  # nothing answered yet
        for req in held:
            await h.broker.frames.send(codecs.Response.build(
                10, 2, req.correlation_id, req.api.response.root.default).encode())
        ids = [struct.unpack_from(">i", await h.client.receive())[0] for _ in range(5)]
        assert ids == [1, 2, 3, 4, 5]
        assert not h.pumps.line and h.conn.refused == 3
        # Nothing owed now: a refusal is answered at once, by the client reader.
        await h.client.send(request(3, 12, 6).encode())
        assert struct.unpack_from(">i", await h.client.receive())[0] == 6


async def test_broker_answer_to_no_request_closes_the_connection() -> None:
    async with proxied(echo_handler) as h:
        await h.client.send(request(3, 12, 1).encode())
        assert await h.client.receive() is not None
        await h.broker.frames.send(codecs.Response.build(
            3, 12, 7, codecs.api(3).response.root.default).encode())
        await h.done.wait()
        assert h.pumps.close_reason == "broker broker:9092 sent a response to no request"
        assert await h.client.receive() is None


def test_frame_bytes_helper() -> None:
    assert frame_bytes(b"ab") == b"\x00\x00\x00\x02ab"


def test_a_failing_observer_is_logged_and_the_others_still_see_everything(
        caplog: pytest.LogCaptureFixture) -> None:
    from gatehouse.proxy.hooks import Observers

    class Broken(Observer):
        def request(self, conn: ConnectionInfo, req: codecs.Request, size: int) -> None:
            raise RuntimeError("observer bug")

        def response(self, conn: ConnectionInfo, pending: Pending, size: int, elapsed: float,
                     frame: Any = None) -> None:
            raise RuntimeError("observer bug")

    recorder = Recorder()
    fan_out = Observers([Broken()])
    fan_out.add(recorder)
    conn = ConnectionInfo(id=1, client="127.0.0.1:5555", listener="bootstrap")
    fan_out.request(conn, request(3, 12, 7), 10)
    fan_out.response(conn, Pending(7, 3, 12, 0.0), 10, 0.001)
    assert recorder.requests == [(3, 12)] and recorder.responses == [7]
    failures = [r.getMessage() for r in caplog.records if r.name == "gatehouse.proxy"]
    assert failures == ["observer Broken failed in request", "observer Broken failed in response"]


def test_the_metrics_failing_in_c_are_logged_as_the_metrics(
        caplog: pytest.LogCaptureFixture) -> None:
    from gatehouse.metrics import ProxyMetrics
    from gatehouse.proxy.hooks import Observers

    class NotARequest:  # no header: the metrics' counting (in C where built) raises
        pass

    metrics = ProxyMetrics()
    fan_out = Observers([metrics])
    conn = ConnectionInfo(id=1, client="127.0.0.1:5555", listener="bootstrap")
    for req in (request(3, 12, 7), NotARequest(), request(3, 12, 8)):
        fan_out.request(conn, req, 10)  # type: ignore[arg-type]
    assert metrics.registry.get_sample_value("gatehouse_requests_total", {
        "api": "Metadata", "version": "12", "client_software": "unknown",
        "listener": "bootstrap"}) == 2
    failures = [r.getMessage() for r in caplog.records if r.name == "gatehouse.proxy"]
    assert failures == ["observer ProxyMetrics failed in request"]


async def test_the_proxy_authenticates_again_before_the_brokers_session_ends(
        autojump_clock: trio.testing.MockClock) -> None:
    """sasl.upstream against a broker with connections.max.reauth.ms (KIP-368): once 85%
    of the session has passed, the next request waits for the answers owed, the proxy
    authenticates again on the same connection (its answers kept from the client), and
    the request goes on; the client notices nothing."""
    sessions: list[float] = []
    held: list[codecs.Request] = []

    def broker(req: codecs.Request) -> Any:
        if req.api_key == 17:
            return response_body(17, 1, mechanisms=["PLAIN"])
        if req.api_key == 36:
            assert bytes(req.body.auth_bytes) == b"\0proxy\0pw"
            sessions.append(trio.current_time())
            return response_body(36, 1, session_lifetime_ms=100_000)
        if req.api_key == 3 and req.correlation_id == 7:
            held.append(req)  # in flight when the session comes due
            return None
        return echo_handler(req)

    credentials = SaslCredentials("PLAIN", "proxy", "pw")
    async with proxied(broker, upstream_session=100.0,
                       upstream_credentials=credentials) as h:
        await h.client.send(request(3, 12, 7).encode())
        while not held:
            await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(90)  # past 85 s
        await h.client.send(request(3, 12, 8).encode())
        await trio.testing.wait_all_tasks_blocked()
        assert not sessions  # not while an answer is owed
        await answer_held(h, held[0])
        assert struct.unpack_from(">i", await h.client.receive())[0] == 8
        assert len(sessions) == 1 and sessions[0] >= 90
        keys = [codecs.decode_request(r).api_key for r in h.broker.received]
        assert keys == [3, 17, 36, 3]
        # The next session comes due 85 s after this one began.
        await trio.sleep(86)
        await h.client.send(request(3, 12, 9).encode())
        assert struct.unpack_from(">i", await h.client.receive())[0] == 9
        assert len(sessions) == 2
        assert h.pumps.conn.responses == 3  # the proxy's own answers are not counted
        assert not h.done.is_set()


async def test_a_refused_reauthentication_closes_the_connection(
        autojump_clock: trio.testing.MockClock) -> None:
    def broker(req: codecs.Request) -> Any:
        if req.api_key == 17:
            return response_body(17, 1, mechanisms=["PLAIN"])
        if req.api_key == 36:
            return response_body(36, 1, error_code=58, error_message="Invalid credentials")
        return echo_handler(req)

    async with proxied(broker, upstream_session=10.0,
                       upstream_credentials=SaslCredentials("PLAIN", "proxy", "old")) as h:
        await trio.sleep(9)
        await h.client.send(request(3, 12, 1).encode())
        await h.done.wait()
        assert h.pumps.close_reason == ("re-authentication to broker broker:9092 failed: the "
                                        "broker refused 'proxy' (PLAIN): Invalid credentials")
        assert [codecs.decode_request(r).api_key for r in h.broker.received] == [17, 36]


async def test_the_proxys_sasl_answers_keep_their_place_in_line(tmp_path: Path) -> None:
    """sasl.downstream: a SaslHandshake pipelined behind an ApiVersions the broker has
    not answered yet is answered after it; the SASL requests never reach the broker,
    and the client's requests go up once it has authenticated."""
    users_file = tmp_path / "users.yaml"
    users_file.write_text("users:\n  alice: {password: pw}\n")
    held: list[codecs.Request] = []

    def handler(req: codecs.Request) -> Any:
        if req.api_key == 18:
            held.append(req)
            return None  # answered by the test, later
        return echo_handler(req)

    async with proxied(handler, sasl_users=SaslUsers(users_file)) as h:
        await h.client.send(request(18, 3, 1, client_software_name="t",
                                    client_software_version="1").encode())
        await h.client.send(request(17, 1, 2, mechanism="PLAIN").encode())
        while not held:
            await trio.testing.wait_all_tasks_blocked()
        await trio.testing.wait_all_tasks_blocked()
        versions = codecs.Response.build(18, 3, 1, echo_handler(held[0]))
        await h.broker.frames.send(versions.encode())
        first, second = await h.client.receive(), await h.client.receive()
        assert struct.unpack_from(">i", first)[0] == 1
        handshake = codecs.decode_response(second, 17, 1)
        assert handshake.correlation_id == 2 and handshake.body.error_code == 0
        assert handshake.body.mechanisms == ("SCRAM-SHA-256", "PLAIN")
        await h.client.send(request(36, 2, 3, auth_bytes=b"\0alice\0pw").encode())
        answer = codecs.decode_response(await h.client.receive(), 36, 2)
        assert answer.body.error_code == 0 and h.conn.principal == "alice"
        await h.client.send(request(3, 12, 4).encode())
        assert struct.unpack_from(">i", await h.client.receive())[0] == 4
        assert [codecs.decode_request(r).api_key for r in h.broker.received] == [18, 3]


async def test_a_failed_authentication_is_answered_after_a_delay_then_closed(
        tmp_path: Path) -> None:
    """As a broker does (connection.failed.authentication.delay.ms): a client guessing
    passwords waits 100 ms for each answer, and the connection then closes.  (The real
    clock: PLAIN is checked in a thread, which an autojump clock would jump past.)"""
    users_file = tmp_path / "users.yaml"
    users_file.write_text("users:\n  alice: {password: pw}\n")
    async with proxied(echo_handler, sasl_users=SaslUsers(users_file)) as h:
        await h.client.send(request(17, 1, 1, mechanism="PLAIN").encode())
        assert codecs.decode_response(await h.client.receive(), 17, 1).body.error_code == 0
        started = trio.current_time()
        await h.client.send(request(36, 2, 2, auth_bytes=b"\0alice\0guess").encode())
        answer = codecs.decode_response(await h.client.receive(), 36, 2)
        assert answer.body.error_code == 58
        assert answer.body.error_message == "Authentication failed: Invalid username or password"
        assert trio.current_time() - started >= 0.1
        await h.done.wait()
        assert h.pumps.close_reason == ("SASL authentication as 'alice' (PLAIN) failed: "
                                        "invalid credentials")
        assert h.conn.principal is None and not h.broker.received


async def scram_login(h: Harness, user: str, password: str, first_id: int,
                      version: int = 2) -> codecs.Response:
    """SaslHandshake v1 then SCRAM-SHA-256 in two SaslAuthenticate (``version``); the
    last answer."""
    await h.client.send(request(17, 1, first_id, mechanism="SCRAM-SHA-256").encode())
    assert codecs.decode_response(await h.client.receive(), 17, 1).body.error_code == 0
    scram = ScramClient("SCRAM-SHA-256", user, password)
    await h.client.send(request(36, version, first_id + 1,
                                auth_bytes=scram.first_message()).encode())
    first = codecs.decode_response(await h.client.receive(), 36, version)
    assert first.body.error_code == 0, first.body
    await h.client.send(request(36, version, first_id + 2, auth_bytes=scram.final_message(
        bytes(first.body.auth_bytes))).encode())
    final = codecs.decode_response(await h.client.receive(), 36, version)
    if final.body.error_code == 0:
        scram.check_final(bytes(final.body.auth_bytes))
    return final


async def test_a_client_authenticates_again_before_its_session_ends(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """sasl.downstream.session_lifetime (KIP-368, as a broker's connections.max.reauth.ms):
    the answer says how long the session lasts; the client authenticates again on the
    same connection (same mechanism, same user) and goes on; a client that does not is
    closed at its first request after the session."""
    users_file = tmp_path / "users.yaml"
    users_file.write_text("users:\n  alice: {password: pw}\n  bob: {password: pw2}\n")
    users = SaslUsers(users_file)
    async with proxied(echo_handler, sasl_users=users, sasl_session_lifetime=10.0) as h:
        final = await scram_login(h, "alice", "pw", 1)
        assert final.body.session_lifetime_ms == 10_000
        await trio.sleep(8)
        final = await scram_login(h, "alice", "pw", 4)  # again, before the end
        assert final.body.error_code == 0 and final.body.session_lifetime_ms == 10_000
        await trio.sleep(8)  # 16 s in: past the first session, within the second
        await h.client.send(request(3, 12, 7).encode())
        assert struct.unpack_from(">i", await h.client.receive())[0] == 7
        await trio.sleep(3)  # past the second session: the next request closes it
        await h.client.send(request(3, 12, 8).encode())
        assert await h.client.receive() is None
        await h.done.wait()
        assert h.pumps.close_reason.startswith("SASL session expired")
        assert [codecs.decode_request(r).api_key for r in h.broker.received] == [3]

    # Authenticating again as someone else is refused (a connection keeps its user).
    async with proxied(echo_handler, sasl_users=users, sasl_session_lifetime=10.0) as h:
        await scram_login(h, "alice", "pw", 1)
        final = await scram_login(h, "bob", "pw2", 4)
        assert final.body.error_code == 58
        await h.done.wait()
        assert "re-authentication as 'bob' by a connection of 'alice'" in h.pumps.close_reason
        assert h.conn.principal == "alice"

    # Without a session lifetime there is nothing to renew: a second handshake closes.
    async with proxied(echo_handler, sasl_users=users) as h:
        final = await scram_login(h, "alice", "pw", 1)
        assert final.body.session_lifetime_ms == 0
        await h.client.send(request(17, 1, 4, mechanism="SCRAM-SHA-256").encode())
        assert await h.client.receive() is None
        await h.done.wait()
        assert "asks for no re-authentication" in h.pumps.close_reason


async def test_a_policys_long_work_runs_off_the_event_loop() -> None:
    """``Policy.offload``'s work runs in a thread before ``on_request``: while it waits
    (here on the test, which only the event loop can reach) the loop serves on; run on
    the loop itself, it would hold the test and time out instead."""
    import threading

    started, release = threading.Event(), threading.Event()
    ran: list[tuple[bool, bool]] = []  # (in a thread of its own, released)

    class Slow(Policy):
        def offload(self, conn: ConnectionInfo, req: codecs.Request) -> Any:
            if req.api_key != 3:
                return None

            def work() -> None:
                started.set()
                ran.append((threading.current_thread() is not threading.main_thread(),
                            release.wait(10)))
                conn.state["seen"] = req

            return work

        def on_request(self, conn: ConnectionInfo, req: codecs.Request) -> Any:
            assert req.api_key != 3 or conn.state.get("seen") is req  # after the work
            return Forward(req)

    async with proxied(echo_handler, policy=Slow()) as h:
        await h.client.send(request(3, 12, 1, topics=[]).encode())
        await trio.to_thread.run_sync(started.wait)
        await trio.sleep(0)  # the loop goes on while the work waits
        release.set()
        answer = await h.client.receive()
        assert answer is not None and struct.unpack_from(">i", answer)[0] == 1
    assert ran == [(True, True)]
