"""The group census: which groups have members behind this proxy, by protocol.

Fed by the metrics observer with the group APIs' requests and responses:

* classic groups (JoinGroup/SyncGroup/LeaveGroup): ``protocol_type`` as the JoinGroup
  declared it (``consumer``, ``connect``, ...), ``protocol`` the one the coordinator chose
  (``range``, ``cooperative-sticky``, ...);
* KIP-848 consumer groups (ConsumerGroupHeartbeat): ``consumer`` and the server-side
  assignor the member asked for (``uniform``, ``range``), ``default`` if none;
* share groups (ShareGroupHeartbeat) and streams groups (StreamsGroupHeartbeat):
  ``share`` / ``streams`` and ``default``.

A group counts while at least one of its members' connections through this proxy is
open and has not left.  Memory is bounded (groups per connection, groups in all).

The same requests and responses tell which frames carry group payloads (member metadata,
assignments) whose version predates KIP-559 (JoinGroup response < v7, SyncGroup < v5):
their bytes do not say what protocol they are, so decoding them (a topic rename does)
needs the protocol type this connection's JoinGroup declared for the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from gatehouse.codecs import Request, Response

JOIN_GROUP, SYNC_GROUP, LEAVE_GROUP = 11, 14, 13
CONSUMER_HEARTBEAT, SHARE_HEARTBEAT, STREAMS_HEARTBEAT = 68, 76, 88
GROUP_APIS = frozenset({JOIN_GROUP, SYNC_GROUP, LEAVE_GROUP, CONSUMER_HEARTBEAT,
                        SHARE_HEARTBEAT, STREAMS_HEARTBEAT})
# Responses the census needs decoded (LeaveGroup is settled by its request).
GROUP_RESPONSES = GROUP_APIS - {LEAVE_GROUP}
HEARTBEAT_TYPES = {CONSUMER_HEARTBEAT: "consumer", SHARE_HEARTBEAT: "share",
                   STREAMS_HEARTBEAT: "streams"}
# First versions whose group payloads say their protocol type (KIP-559).
STATELESS_SINCE = {(JOIN_GROUP, "response"): 7, (SYNC_GROUP, "request"): 5,
                   (SYNC_GROUP, "response"): 5}
API_NAMES = {JOIN_GROUP: "JoinGroup", SYNC_GROUP: "SyncGroup"}
DEFAULT_PROTOCOL = "default"
# Answers that say the member is out of the group (it rejoins from scratch).
NOT_A_MEMBER = frozenset({25, 110})  # UNKNOWN_MEMBER_ID, FENCED_MEMBER_EPOCH
LEAVING_EPOCHS = frozenset({-1, -2})  # KIP-848: leave, static member leaves temporarily
GROUPS_PER_CONNECTION = 64
MAX_GROUPS = 10_000
MAX_IN_FLIGHT = 256  # group requests per connection awaiting their responses


@dataclass(slots=True)
class _Group:
    labels: tuple[str, str]
    members: set[int] = field(default_factory=set)  # connection ids


@dataclass(slots=True)
class _Asked:
    """What a group request said that its response does not repeat."""

    group_id: str
    protocol_type: str | None = None  # JoinGroup
    protocol: str | None = None  # ConsumerGroupHeartbeat's server assignor
    leaving: bool = False


class GroupCensus:
    def __init__(self, groups: Gauge, fallbacks: Counter,
                 label: Callable[[str], str]) -> None:
        self.gauge = groups
        self.fallbacks = fallbacks
        self.label = label  # caps client-chosen label values
        self.groups: dict[str, _Group] = {}
        self.of_connection: dict[int, set[str]] = {}
        # connection id -> group id -> protocol type its JoinGroup declared
        self.declared: dict[int, dict[str, str]] = {}
        self.asked: dict[int, dict[int, _Asked]] = {}

    # -- fed by the observer --------------------------------------------------------

    def request(self, conn_id: int, req: Request) -> None:
        key = req.api_key
        body = req.body
        group_id = str(body.group_id)
        if key == LEAVE_GROUP:
            self._leave(conn_id, group_id)
            return
        asked = _Asked(group_id)
        if key == JOIN_GROUP:
            asked.protocol_type = str(body.protocol_type)
            declared = self.declared.setdefault(conn_id, {})
            if len(declared) >= GROUPS_PER_CONNECTION and group_id not in declared:
                declared.clear()
            declared[group_id] = asked.protocol_type
        elif key == SYNC_GROUP:
            if body.assignments:
                self._payload(conn_id, key, group_id, "request", req.api_version)
        else:  # the heartbeats
            asked.leaving = body.member_epoch in LEAVING_EPOCHS
            asked.protocol = getattr(body, "server_assignor", None)
        in_flight = self.asked.setdefault(conn_id, {})
        if len(in_flight) >= MAX_IN_FLIGHT:
            in_flight.clear()  # responses that never came (bounded, not exact)
        in_flight[req.correlation_id] = asked

    def response(self, conn_id: int, correlation_id: int, resp: Response) -> None:
        asked = self.asked.get(conn_id, {}).pop(correlation_id, None)
        if asked is None:
            return
        key = resp.api_key
        body = resp.body
        if (key == SYNC_GROUP and body.assignment) or (key == JOIN_GROUP and body.members):
            self._payload(conn_id, key, asked.group_id, "response", resp.api_version)
        if asked.leaving or body.error_code in NOT_A_MEMBER:
            # A member that sent its leave heartbeat is out whatever the answer: the clients
            # count themselves out once it is sent and never resend it.  (Settled here, not
            # at the request: answers to its earlier heartbeats come first on the connection.)
            self._leave(conn_id, asked.group_id)
            return
        if body.error_code != 0:
            return
        if key == JOIN_GROUP:
            protocol_type = body.protocol_type or asked.protocol_type or ""
            self._join(conn_id, asked.group_id, protocol_type, body.protocol_name or "")
        elif key == SYNC_GROUP:
            if body.protocol_type and body.protocol_name:
                self._join(conn_id, asked.group_id, body.protocol_type, body.protocol_name)
        else:
            protocol_type = HEARTBEAT_TYPES[key]
            current = self.groups.get(asked.group_id)
            # A null assignor means "unchanged" (KIP-848); share and streams heartbeats
            # name none (their assignors are the broker's).
            protocol = asked.protocol or (
                current.labels[1]
                if current is not None and current.labels[0] == self.label(protocol_type)
                else DEFAULT_PROTOCOL)
            self._join(conn_id, asked.group_id, protocol_type, protocol)

    def connection_closed(self, conn_id: int) -> None:
        for group_id in self.of_connection.pop(conn_id, set()):
            self._leave(conn_id, group_id, forget=False)
        self.declared.pop(conn_id, None)
        self.asked.pop(conn_id, None)

    # -- bookkeeping -----------------------------------------------------------------

    def _payload(self, conn_id: int, api_key: int, group_id: str, direction: str,
                 version: int) -> None:
        """A frame with group payloads: count it if its bytes need the connection's state."""
        if version >= STATELESS_SINCE[(api_key, direction)]:
            return
        # As the topic rewrite does: the group's own JoinGroup, else the one protocol
        # type this connection declared.
        declared = self.declared.get(conn_id, {})
        resolved = group_id in declared or len(set(declared.values())) == 1
        self.fallbacks.labels(api=API_NAMES[api_key], direction=direction,
                              outcome="resolved" if resolved else "unresolved").inc()

    def _join(self, conn_id: int, group_id: str, protocol_type: str, protocol: str) -> None:
        mine = self.of_connection.setdefault(conn_id, set())
        if group_id not in mine and len(mine) >= GROUPS_PER_CONNECTION:
            return  # bounded: the census undercounts rather than grows
        labels = (self.label(protocol_type), self.label(protocol))
        group = self.groups.get(group_id)
        if group is None:
            if len(self.groups) >= MAX_GROUPS:
                return
            group = self.groups[group_id] = _Group(labels)
            self.gauge.labels(*labels).inc()
        elif group.labels != labels:
            self.gauge.labels(*group.labels).dec()
            self.gauge.labels(*labels).inc()
            group.labels = labels
        group.members.add(conn_id)
        mine.add(group_id)

    def _leave(self, conn_id: int, group_id: str, forget: bool = True) -> None:
        if forget:
            self.of_connection.get(conn_id, set()).discard(group_id)
        group = self.groups.get(group_id)
        if group is None:
            return
        group.members.discard(conn_id)
        if not group.members:
            self.gauge.labels(*group.labels).dec()
            del self.groups[group_id]

