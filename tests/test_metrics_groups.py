"""The group census, the KIP-559 fallback counter and topic-id naming, frame by frame.

The observer is fed what the connection pumps feed it: requests decoded from bytes and
response frames as sent to the client.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from gatehouse import codecs
from gatehouse.metrics import ProxyMetrics
from gatehouse.proxy.hooks import ConnectionInfo, Pending, scanned_response

_correlation = itertools.count(1)


class Wire:
    """One client connection's traffic into a ProxyMetrics."""

    def __init__(self, metrics: ProxyMetrics, conn_id: int) -> None:
        self.metrics = metrics
        self.conn = ConnectionInfo(id=conn_id, client="127.0.0.1:1", listener="bootstrap")
        metrics.connection_opened(self.conn)

    def exchange(self, api_key: int, version: int, request: dict[str, Any],
                 response: dict[str, Any]) -> None:
        correlation_id = next(_correlation)
        plain = {"header": {"api_key": api_key, "api_version": version,
                            "correlation_id": correlation_id, "client_id": "app"},
                 "body": request}
        req = codecs.decode_request(bytes(codecs.request_from_dict(plain).encode()))
        self.metrics.request(self.conn, req, 100)
        frame = bytes(codecs.response_from_dict(
            {"header": {"correlation_id": correlation_id}, "body": response},
            api_key=api_key, api_version=version).encode())
        pending = Pending(correlation_id, api_key, version, 0.0)
        self.metrics.response(self.conn, pending, len(frame), 0.001, memoryview(frame))

    def close(self) -> None:
        self.metrics.connection_closed(self.conn, "client closed")


def join(wire: Wire, group: str, version: int = 5, protocol_type: str = "consumer",
         chosen: str = "range", leader: bool = True) -> None:
    members = [{"member_id": "m", "group_instance_id": None, "metadata": b"\x00\x01x"}]
    response: dict[str, Any] = {"generation_id": 1, "protocol_name": chosen, "leader": "m",
                                "member_id": "m", "members": members if leader else []}
    if version >= 7:
        response["protocol_type"] = protocol_type
    wire.exchange(11, version, {"group_id": group, "session_timeout_ms": 10000,
                                "rebalance_timeout_ms": 10000, "member_id": "",
                                "group_instance_id": None, "protocol_type": protocol_type,
                                "protocols": [{"name": chosen, "metadata": b"\x00\x01x"}]},
                  response)


def sync(wire: Wire, group: str, version: int = 3) -> None:
    request: dict[str, Any] = {"group_id": group, "generation_id": 1, "member_id": "m",
                               "group_instance_id": None,
                               "assignments": [{"member_id": "m", "assignment": b"\x00\x01a"}]}
    response: dict[str, Any] = {"assignment": b"\x00\x01a"}
    if version >= 5:
        request.update(protocol_type="consumer", protocol_name="range")
        response.update(protocol_type="consumer", protocol_name="range")
    wire.exchange(14, version, request, response)


def groups(metrics: ProxyMetrics, protocol_type: str, protocol: str) -> float:
    value = metrics.registry.get_sample_value(
        "gatehouse_consumer_groups", {"protocol_type": protocol_type, "protocol": protocol})
    return value or 0.0


def fallbacks(metrics: ProxyMetrics, api: str, direction: str, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "gatehouse_group_protocol_fallbacks_total",
        {"api": api, "direction": direction, "outcome": outcome})
    return value or 0.0


def test_classic_group_counted_once_across_members_until_the_last_leaves() -> None:
    metrics = ProxyMetrics()
    a, b = Wire(metrics, 1), Wire(metrics, 2)
    join(a, "g1")
    join(b, "g1", leader=False)
    assert groups(metrics, "consumer", "range") == 1
    a.exchange(13, 5, {"group_id": "g1", "members": [
        {"member_id": "m", "group_instance_id": None, "reason": None}]},
        {"members": [{"member_id": "m", "group_instance_id": None}]})
    assert groups(metrics, "consumer", "range") == 1  # b is still a member
    b.close()
    assert groups(metrics, "consumer", "range") == 0


def test_rebalance_to_another_protocol_moves_the_group() -> None:
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    join(wire, "g", version=9, chosen="range")
    join(wire, "g", version=9, chosen="cooperative-sticky")
    assert groups(metrics, "consumer", "range") == 0
    assert groups(metrics, "consumer", "cooperative-sticky") == 1
    join(wire, "c", version=9, protocol_type="connect", chosen="sessioned")
    assert groups(metrics, "connect", "sessioned") == 1


def test_pre_kip559_frames_resolved_from_the_connections_join() -> None:
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    join(wire, "g", version=5)  # the leader's response carries member metadata
    sync(wire, "g", version=3)
    for api, direction in (("JoinGroup", "response"), ("SyncGroup", "request"),
                           ("SyncGroup", "response")):
        assert fallbacks(metrics, api, direction, "resolved") == 1
        assert fallbacks(metrics, api, direction, "unresolved") == 0


def test_kip559_versions_need_no_fallback() -> None:
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    join(wire, "g", version=9)
    sync(wire, "g", version=5)
    total = sum(s.value for family in metrics.registry.collect() for s in family.samples
                if s.name == "gatehouse_group_protocol_fallbacks_total")
    assert total == 0


def test_sync_without_a_join_on_the_connection_is_unresolved() -> None:
    """A client that moved its SyncGroup to another connection (or a proxy restarted
    mid-group): the bytes cannot be told apart."""
    metrics = ProxyMetrics()
    sync(Wire(metrics, 7), "g", version=3)
    assert fallbacks(metrics, "SyncGroup", "request", "unresolved") == 1
    assert fallbacks(metrics, "SyncGroup", "response", "unresolved") == 1


def heartbeat(wire: Wire, group: str, epoch: int, assignor: str | None) -> None:
    wire.exchange(68, 1, {"group_id": group, "member_id": "m", "member_epoch": epoch,
                          "instance_id": None, "rack_id": None, "rebalance_timeout_ms": 1000,
                          "subscribed_topic_names": None, "subscribed_topic_regex": None,
                          "server_assignor": assignor, "topic_partitions": None},
                  {"error_code": 0, "error_message": None, "member_id": "m",
                   "member_epoch": max(epoch, 0) + 1, "heartbeat_interval_ms": 5000,
                   "assignment": None})


def test_kip848_group_keeps_its_assignor_until_the_member_leaves() -> None:
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    heartbeat(wire, "g", 0, "uniform")
    heartbeat(wire, "g", 1, None)  # null: unchanged
    assert groups(metrics, "consumer", "uniform") == 1
    heartbeat(wire, "g", -1, None)  # leave
    assert groups(metrics, "consumer", "uniform") == 0
    heartbeat(wire, "h", 0, None)
    assert groups(metrics, "consumer", "default") == 1
    # Fenced: the member is out until it joins again.
    wire.exchange(68, 1, {"group_id": "h", "member_id": "m", "member_epoch": 3,
                          "instance_id": None, "rack_id": None, "rebalance_timeout_ms": 1000,
                          "subscribed_topic_names": None, "subscribed_topic_regex": None,
                          "server_assignor": None, "topic_partitions": None},
                  {"error_code": 110, "error_message": "fenced", "member_id": None,
                   "member_epoch": -1, "heartbeat_interval_ms": 0, "assignment": None})
    assert groups(metrics, "consumer", "default") == 0
    heartbeat(wire, "h", 0, None)
    assert groups(metrics, "consumer", "default") == 1
    wire.close()
    assert groups(metrics, "consumer", "default") == 0


def test_fetch_by_topic_id_is_unknown_until_metadata_names_it() -> None:
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    topic_id = uuid.uuid4()
    batch = one_record_batch()

    def fetch() -> None:
        wire.exchange(1, 13, {"replica_id": -1, "max_wait_ms": 500, "min_bytes": 1,
                              "max_bytes": 1 << 20, "isolation_level": 0, "session_id": 0,
                              "session_epoch": -1, "topics": [], "forgotten_topics_data": [],
                              "rack_id": ""},
                      {"error_code": 0, "session_id": 0, "responses": [
                          {"topic_id": topic_id, "partitions": [
                              {"partition_index": 0, "error_code": 0, "high_watermark": 1,
                               "last_stable_offset": 1, "log_start_offset": 0,
                               "aborted_transactions": None, "preferred_read_replica": -1,
                               "records": batch}]}]})

    def records(topic: str) -> float:
        value = metrics.registry.get_sample_value(
            "gatehouse_topic_records_total", {"topic": topic, "direction": "fetch"})
        return value or 0.0

    fetch()
    assert records("unknown") == 1
    name_topic(wire, topic_id, "orders")
    fetch()
    assert records("orders") == 1
    assert records("unknown") == 1


def test_a_share_consumers_records_count_as_fetched() -> None:
    """ShareFetch (KIP-932) answers carry records as Fetch answers do: counted per topic
    (by id, named from Metadata)."""
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    topic_id = uuid.uuid4()
    name_topic(wire, topic_id, "jobs")
    for _ in range(2):
        wire.exchange(78, 1, {"group_id": "workers", "member_id": "m", "share_session_epoch": 0,
                              "max_wait_ms": 500, "min_bytes": 1, "max_bytes": 1 << 20,
                              "max_records": 500, "batch_size": 500, "topics": [
                                  {"topic_id": topic_id, "partitions": [
                                      {"partition_index": 0, "acknowledgement_batches": []}]}],
                              "forgotten_topics_data": []},
                      {"error_code": 0, "error_message": None,
                       "acquisition_lock_timeout_ms": 30000, "responses": [
                           {"topic_id": topic_id, "partitions": [
                               {"partition_index": 0, "error_code": 0, "error_message": None,
                                "acknowledge_error_code": 0, "acknowledge_error_message": None,
                                "current_leader": {"leader_id": 1, "leader_epoch": 0},
                                "records": one_record_batch(),
                                "acquired_records": [{"first_offset": 0, "last_offset": 0,
                                                      "delivery_count": 1}]}]}],
                       "node_endpoints": []})
    assert metrics.registry.get_sample_value(
        "gatehouse_topic_records_total", {"topic": "jobs", "direction": "fetch"}) == 2
    assert metrics.registry.get_sample_value(
        "gatehouse_topic_bytes_total", {"topic": "jobs", "direction": "fetch"}) == 2 * len(
            one_record_batch())


def name_topic(wire: Wire, topic_id: uuid.UUID, name: str) -> None:
    """A Metadata exchange that tells the proxy the name of a topic id."""
    wire.exchange(3, 12, {"topics": None, "allow_auto_topic_creation": False,
                          "include_topic_authorized_operations": False},
                  {"brokers": [], "cluster_id": None, "controller_id": 1, "topics": [
                      {"error_code": 0, "name": name, "topic_id": topic_id,
                       "is_internal": False, "partitions": [],
                       "topic_authorized_operations": 0}]})


def one_record_batch() -> bytes:
    """A record batch v2 header claiming one record (the counters read headers only)."""
    import struct

    body = struct.pack(">hiqqqhii", 0, 0, 0, 0, -1, -1, -1, 1) + b"\x00" * 8
    length = 4 + 1 + 4 + len(body)  # leader epoch, magic, crc, rest
    return struct.pack(">qii", 0, length, 0) + b"\x02" + struct.pack(">I", 0) + body


# -- share groups (KIP-932, ShareGroupHeartbeat) and streams groups (KIP-1071,
# -- StreamsGroupHeartbeat): counted by their heartbeats, like KIP-848 consumer groups ---------

SHARE, STREAMS = 76, 88
UNKNOWN_MEMBER_ID, FENCED_MEMBER_EPOCH, NOT_COORDINATOR = 25, 110, 16
COORDINATOR_LOAD_IN_PROGRESS, GROUP_AUTHORIZATION_FAILED = 14, 30


def share_heartbeat(wire: Wire, group: str, epoch: int, error: int = 0,
                    member: str = "m") -> None:
    request: dict[str, Any] = {"group_id": group, "member_id": member, "member_epoch": epoch}
    if epoch == 0:
        request["subscribed_topic_names"] = ["orders"]
    wire.exchange(SHARE, 1, request,
                  {"error_code": error, "member_id": None if error else member,
                   "member_epoch": -1 if error else max(epoch, 0) + 1,
                   "heartbeat_interval_ms": 5000})


def streams_heartbeat(wire: Wire, group: str, epoch: int, error: int = 0,
                      member: str = "m", version: int = 1) -> None:
    request: dict[str, Any] = {"group_id": group, "member_id": member, "member_epoch": epoch,
                               "endpoint_information_epoch": 0}
    if epoch == 0:
        request.update(process_id="p", topology={"epoch": 0, "subtopologies": [
            {"subtopology_id": "0", "source_topics": ["orders"], "source_topic_regex": [],
             "state_changelog_topics": [], "repartition_sink_topics": [],
             "repartition_source_topics": [], "copartition_groups": []}]})
    wire.exchange(STREAMS, version, request,
                  {"error_code": error, "member_id": member,
                   "member_epoch": -1 if error else max(epoch, 0) + 1,
                   "heartbeat_interval_ms": 5000, "status": None})


def test_share_group_counted_once_across_members_until_the_last_leaves() -> None:
    metrics = ProxyMetrics()
    a, b = Wire(metrics, 1), Wire(metrics, 2)
    share_heartbeat(a, "s", 0, member="a")
    share_heartbeat(b, "s", 0, member="b")
    share_heartbeat(a, "s", 1, member="a")  # a steady heartbeat changes nothing
    assert groups(metrics, "share", "default") == 1
    share_heartbeat(a, "s", -1, member="a")  # a leaves; b is still a member
    assert groups(metrics, "share", "default") == 1
    share_heartbeat(b, "s", -1, member="b")
    assert groups(metrics, "share", "default") == 0
    # Only the share label moved: no consumer group was counted on the way.
    assert groups(metrics, "consumer", "default") == 0


def test_streams_group_counted_once_until_its_last_member_connection_closes() -> None:
    metrics = ProxyMetrics()
    a, b = Wire(metrics, 1), Wire(metrics, 2)
    streams_heartbeat(a, "app", 0, member="a")
    streams_heartbeat(b, "app", 0, member="b", version=0)  # a 4.0 client
    streams_heartbeat(b, "app", 1, member="b", version=0)
    assert groups(metrics, "streams", "default") == 1
    a.close()  # a JVM that died: no leave heartbeat, its connection closed
    assert groups(metrics, "streams", "default") == 1
    streams_heartbeat(b, "app", -1, member="b")
    assert groups(metrics, "streams", "default") == 0
    b.close()  # nothing left to take out
    assert groups(metrics, "streams", "default") == 0


def test_share_and_streams_groups_are_counted_apart() -> None:
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    share_heartbeat(wire, "s1", 0)
    share_heartbeat(wire, "s2", 0)
    streams_heartbeat(wire, "app", 0)
    assert groups(metrics, "share", "default") == 2
    assert groups(metrics, "streams", "default") == 1
    wire.close()
    assert groups(metrics, "share", "default") == 0
    assert groups(metrics, "streams", "default") == 0


def test_fenced_or_unknown_members_are_out_until_they_join_again() -> None:
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    share_heartbeat(wire, "s", 0)
    share_heartbeat(wire, "s", 1, error=UNKNOWN_MEMBER_ID)
    assert groups(metrics, "share", "default") == 0
    share_heartbeat(wire, "s", 0)
    assert groups(metrics, "share", "default") == 1
    streams_heartbeat(wire, "app", 0)
    streams_heartbeat(wire, "app", 3, error=FENCED_MEMBER_EPOCH)
    assert groups(metrics, "streams", "default") == 0
    assert groups(metrics, "share", "default") == 1  # the other group is untouched
    streams_heartbeat(wire, "app", 0)
    assert groups(metrics, "streams", "default") == 1


def test_other_errors_neither_join_nor_drop_a_member() -> None:
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    share_heartbeat(wire, "s", 0, error=GROUP_AUTHORIZATION_FAILED)
    assert groups(metrics, "share", "default") == 0
    share_heartbeat(wire, "s", 0)
    share_heartbeat(wire, "s", 1, error=COORDINATOR_LOAD_IN_PROGRESS)  # retried by the client
    assert groups(metrics, "share", "default") == 1


def test_a_leave_heartbeat_answered_with_an_error_still_leaves() -> None:
    """The clients count themselves out once the leave heartbeat is sent and never resend
    it, so the census must not keep the member until its connection closes."""
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    share_heartbeat(wire, "s", 0)
    streams_heartbeat(wire, "app", 0)
    share_heartbeat(wire, "s", -1, error=NOT_COORDINATOR)
    streams_heartbeat(wire, "app", -1, error=UNKNOWN_MEMBER_ID)
    assert groups(metrics, "share", "default") == 0
    assert groups(metrics, "streams", "default") == 0


def test_a_share_heartbeat_does_not_inherit_a_consumer_assignor() -> None:
    """Share and streams heartbeats name no assignor; a group id last seen as a KIP-848
    group with one (on another connection) is relabelled, not counted as share/uniform."""
    metrics = ProxyMetrics()
    heartbeat(Wire(metrics, 1), "g", 0, "uniform")
    share_heartbeat(Wire(metrics, 2), "g", 0)
    assert groups(metrics, "share", "uniform") == 0
    assert groups(metrics, "share", "default") == 1
    assert groups(metrics, "consumer", "uniform") == 0


def test_a_topic_without_a_name_is_unknown_in_produce_as_in_fetch() -> None:
    """A nameless topic (empty name, no id known) is one label, "unknown", both ways."""
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    batch = one_record_batch()
    wire.exchange(0, 9, {"transactional_id": None, "acks": 1, "timeout_ms": 1000,
                         "topic_data": [{"name": "", "partition_data": [
                             {"index": 0, "records": batch}]}]},
                  {"responses": [{"name": "", "partition_responses": [
                      {"index": 0, "error_code": 0, "base_offset": 0, "log_append_time_ms": -1,
                       "log_start_offset": 0, "record_errors": [], "error_message": None}]}],
                   "throttle_time_ms": 0})
    wire.exchange(1, 12, {"replica_id": -1, "max_wait_ms": 500, "min_bytes": 1,
                          "max_bytes": 1 << 20, "isolation_level": 0, "session_id": 0,
                          "session_epoch": -1, "topics": [], "forgotten_topics_data": [],
                          "rack_id": ""},
                  {"throttle_time_ms": 0, "error_code": 0, "session_id": 0, "responses": [
                      {"topic": "", "partitions": [
                          {"partition_index": 0, "error_code": 0, "high_watermark": 1,
                           "last_stable_offset": 1, "log_start_offset": 0,
                           "aborted_transactions": None, "preferred_read_replica": -1,
                           "records": batch}]}]})
    for direction in ("produce", "fetch"):
        assert metrics.registry.get_sample_value(
            "gatehouse_topic_records_total", {"topic": "unknown", "direction": direction}) == 1
        assert metrics.registry.get_sample_value(
            "gatehouse_topic_records_total", {"topic": "", "direction": direction}) is None


def test_produce_by_topic_id_is_unknown_until_metadata_names_it() -> None:
    """The per-topic counters a Produce v13 request finds by id are not remembered
    while the id has no name: once Metadata names it, its records count under the name."""
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    topic_id = uuid.uuid4()

    def produce() -> None:
        wire.exchange(0, 13, {"transactional_id": None, "acks": -1, "timeout_ms": 1000,
                              "topic_data": [{"topic_id": topic_id, "partition_data": [
                                  {"index": 0, "records": one_record_batch()}]}]},
                      {"responses": [{"topic_id": topic_id, "partition_responses": [
                          {"index": 0, "error_code": 0, "base_offset": 0}]}]})

    def records(topic: str) -> float:
        value = metrics.registry.get_sample_value(
            "gatehouse_topic_records_total", {"topic": topic, "direction": "produce"})
        return value or 0.0

    produce()
    produce()
    assert records("unknown") == 2
    name_topic(wire, topic_id, "orders")
    produce()
    produce()
    assert records("orders") == 2
    assert records("unknown") == 2


def test_api_versions_error_codes_are_read_from_the_bytes() -> None:
    """An ApiVersions answer's one error code sits right after its correlation id: it is
    counted from there (the ~90 entries are not decoded), in the v0 layout as well."""
    metrics = ProxyMetrics()
    wire = Wire(metrics, 1)
    entries = [{"api_key": 18, "min_version": 0, "max_version": 4}]
    wire.exchange(18, 3, {"client_software_name": "x", "client_software_version": "1"},
                  {"error_code": 0, "api_keys": entries})
    wire.exchange(18, 0, {}, {"error_code": 35, "api_keys": entries})
    for error in ("NONE", "UNSUPPORTED_VERSION"):
        assert metrics.registry.get_sample_value(
            "gatehouse_responses_total", {"api": "ApiVersions", "error": error}) == 1
    frame = codecs.response_from_dict({"header": {"correlation_id": 5}, "body": {
        "error_code": 35, "api_keys": entries}}, api_key=18, api_version=3).encode()
    pending = Pending(5, 18, 3, 0.0)
    assert scanned_response(pending, bytes(frame)) == ({35: 1}, ())
    assert scanned_response(Pending(5, 18, 3, 0.0), b"\x00\x00\x00\x05\x00") is None
