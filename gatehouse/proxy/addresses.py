"""Which responses tell clients where brokers are, and rewriting them (pure, no I/O).

Found from the tables, not a hand list: a struct in a response of a client-facing
API (one the broker listener serves) with ``Host`` and ``Port`` and a node id
(``NodeId``/``BrokerId``).  In Kafka 4.4 that is Metadata, FindCoordinator (v0-3 at
the top level, v4+ per coordinator), DescribeCluster, the KIP-951 ``NodeEndpoints`` of
Produce v10+ and Fetch v16+, and ShareFetch/ShareAcknowledge.  Raft APIs (controller
listeners) and Streams application endpoints (no node id) are left alone.  One more
place is a config's value, which no table marks: a broker's ``advertised.listeners`` in
DescribeConfigs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from gatehouse.codecs import APIS, FieldSpec, Response, StructSpec, api
from gatehouse.codecs.walk import reaches, rewrite

NODE_ID_ATTRS = ("node_id", "broker_id")


def _is_address_struct(struct: StructSpec) -> bool:
    attrs = {f.attr for f in struct.fields}
    return {"host", "port"} <= attrs and any(a in attrs for a in NODE_ID_ATTRS)


def _is_host_field(f: FieldSpec) -> bool:
    # The predicate is per field; the struct test runs once per struct in ``visit``.
    return f.attr == "host"


@cache
def address_apis() -> frozenset[int]:
    """API keys whose responses may carry broker addresses for clients."""
    keys = set()
    for key, spec in APIS.items():
        if "broker" not in spec.request.listeners:
            continue
        if any(_is_address_struct(s) for s in spec.response.structs.values()) and reaches(
            spec.response, _is_host_field
        ):
            keys.add(key)
    return frozenset(keys)


# DescribeConfigs names brokers in a config's value: a broker's advertised.listeners
# ("PLAINTEXT://host:9092,SSL://host:9093"), the addresses its clients are given.
DESCRIBE_CONFIGS = api("DescribeConfigs").key
BROKER_RESOURCE = 4
LISTENER_CONFIGS = frozenset({"advertised.listeners"})


@cache
def carries_addresses(api_key: int, version: int) -> bool:
    """Whether a response of this API *version* can hold a broker address: Produce < v10
    and Fetch < v16 cannot (no NodeEndpoints), so they need not be decoded for it."""
    if api_key == DESCRIBE_CONFIGS:
        return True
    if api_key not in address_apis():
        return False
    return _struct_has_address(APIS[api_key].response.root, version)


@cache
def address_tags(api_key: int, version: int) -> frozenset[int] | None:
    """The tags of the top-level tagged fields that can hold broker addresses, when only
    such fields can (Produce v10+ and Fetch v16+: NodeEndpoints, tag 0): a response
    without them needs no rewrite, which its tag section shows.  None when untagged
    fields can hold them too (Metadata, FindCoordinator...)."""
    root = APIS[api_key].response.root
    if _is_address_struct(root):
        return None
    tags = set()
    for f in root.fields:
        if f.struct is None or not f.present_in(version) or not _struct_has_address(f.struct, version):
            continue
        if not f.tagged_in(version) or f.tag is None:
            return None
        tags.add(f.tag)
    return frozenset(tags)


def _struct_has_address(struct: StructSpec, version: int) -> bool:
    present = [f for f in struct.fields if f.present_in(version)]
    if _is_address_struct(struct) and any(_is_host_field(f) for f in present):
        return True
    return any(f.struct is not None and _struct_has_address(f.struct, version)
               for f in present)


@dataclass(frozen=True)
class BrokerAddress:
    node_id: int
    host: str
    port: int


# Given the real broker address, return what the client should see (or None: keep).
AddressMapper = Callable[[BrokerAddress], tuple[str, int] | None]


def rewrite_addresses(resp: Response, mapper: AddressMapper) -> tuple[Response, list[BrokerAddress]]:
    """Rewrite every broker address in ``resp``; also return the real addresses seen.

    ``resp`` is returned unchanged (same object) when it carries no address.
    """
    if not resp.known or not carries_addresses(resp.api_key, resp.api_version):
        return resp, []
    if resp.api_key == DESCRIBE_CONFIGS:
        return _rewrite_listener_configs(resp, mapper), []
    seen: list[BrokerAddress] = []

    def visit(struct: StructSpec, record: Any) -> Any:
        if not _is_address_struct(struct):
            return record
        node_id = getattr(record, "node_id", None)
        if node_id is None:
            node_id = record.broker_id
        host = record.host
        if host is None or node_id is None or node_id < 0 or not host:
            return record  # e.g. FindCoordinator's error answer: node -1, host ""
        real = BrokerAddress(node_id, host, record.port)
        seen.append(real)
        mapped = mapper(real)
        if mapped is None or (mapped[0] == host and mapped[1] == record.port):
            return record
        return record.replace(host=mapped[0], port=mapped[1])

    body = rewrite(resp.api.response, resp.api_version, resp.body, _is_host_field, visit)
    if body is resp.body:
        return resp, seen
    return resp.replace(body=body), seen


def _rewrite_listener_configs(resp: Response, mapper: AddressMapper) -> Response:
    """A DescribeConfigs answer with each broker's advertised.listeners (and its
    synonyms' values) naming the proxy's address for that broker in every listener:
    what the broker advertises is where its clients connect, and through the proxy
    that is the proxy.  The brokers are not learnt from it (a value is no Metadata)."""
    results = []
    changed = False
    for result in resp.body.results:
        node_id = _node_of(result)
        configs = []
        ours = False
        for config in result.configs or ():
            if node_id is not None and config.name in LISTENER_CONFIGS:
                value = _mapped_listeners(config.value, node_id, mapper)
                synonyms = tuple(
                    s.replace(value=_mapped_listeners(s.value, node_id, mapper))
                    if s.name in LISTENER_CONFIGS else s for s in config.synonyms or ())
                if value != config.value or synonyms != tuple(config.synonyms or ()):
                    config = config.replace(value=value, synonyms=synonyms)
                    ours = True
            configs.append(config)
        results.append(result.replace(configs=tuple(configs)) if ours else result)
        changed = changed or ours
    if not changed:
        return resp
    return resp.replace(body=resp.body.replace(results=tuple(results)))


def _node_of(result: Any) -> int | None:
    """The broker a DescribeConfigs result is of (its resource name is the node id)."""
    if result.resource_type != BROKER_RESOURCE:
        return None
    try:
        return int(result.resource_name)
    except (TypeError, ValueError):
        return None  # "": the cluster-wide defaults


def _mapped_listeners(value: str | None, node_id: int, mapper: AddressMapper) -> str | None:
    """``NAME://host:port,...`` with each host:port the proxy's for ``node_id``."""
    if not value:
        return value
    out = []
    for listener in value.split(","):
        name, sep, address = listener.strip().partition("://")
        host, colon, port = address.rpartition(":")
        if not sep or not colon or not port.isdigit():
            out.append(listener)  # not NAME://host:port: left as the broker wrote it
            continue
        mapped = mapper(BrokerAddress(node_id, host.strip("[]"), int(port)))
        if mapped is None:
            out.append(listener)
            continue
        proxy_host = f"[{mapped[0]}]" if ":" in mapped[0] else mapped[0]
        out.append(f"{name}://{proxy_host}:{mapped[1]}")
    return ",".join(out)
