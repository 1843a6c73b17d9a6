"""The SASL principal: the user a client claims (PLAIN, SCRAM), taken as its principal
once the broker accepts it, and matched by rules (``match: {principal: ...}``)."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import trio

from gatehouse import codecs
from gatehouse.codecs.sasl import claimed_user
from gatehouse.configfile import ConfigError, load_yaml_text
from gatehouse.proxy.config import config_from_text
from gatehouse.proxy.policy import RulesPolicy
from gatehouse.rules import parse_rules
from tests.support.fakebroker import request, response_body
from tests.test_proxy_pumps import proxied

SASL_AUTHENTICATION_FAILED = 58


def jwt(claims: dict[str, Any]) -> bytes:
    """An (unsigned-looking) JSON Web Token with ``claims``: the proxy reads, the broker
    verifies."""
    def part(value: Any) -> bytes:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=")

    return part({"alg": "none"}) + b"." + part(claims) + b".c2ln"


@pytest.mark.parametrize(("mechanism", "token", "user"), [
    ("PLAIN", b"\0alice\0secret", "alice"),
    ("plain", b"alice\0alice\0secret", "alice"),
    ("PLAIN", b"\0\0secret", None),
    ("PLAIN", b"alice-secret", None),
    ("SCRAM-SHA-256", b"n,,n=alice,r=fyko+d2lbbFgONRv9qkxdawL", "alice"),
    ("SCRAM-SHA-512", b"n,a=al,n=a=2Cb=3Dc,r=abc", "a,b=c"),
    ("SCRAM-SHA-256", b"c=biws,r=abc,p=proof", None),  # a client-final message
    ("SCRAM-SHA-256", b"\xff\xfe", None),
    ("OAUTHBEARER", b"n,,\x01auth=Bearer x\x01\x01", None),
    ("OAUTHBEARER", b"n,,\x01auth=Bearer " + jwt({"sub": "svc-orders"}) + b"\x01\x01",
     "svc-orders"),
    ("OAUTHBEARER", b"n,a=x,\x01host=h\x01auth=bearer " + jwt({"sub": "a", "iat": 1})
     + b"\x01\x01", "a"),
    ("OAUTHBEARER", b"n,,\x01auth=Bearer " + jwt({"scope": "x"}) + b"\x01\x01", None),
    ("OAUTHBEARER", b"n,,\x01auth=Bearer a.%%%.c\x01\x01", None),
    ("GSSAPI", b"\x60\x82", None),
    (None, b"\0alice\0secret", None),
])
def test_the_claimed_user_is_read_from_the_first_token_and_nothing_else(
        mechanism: str | None, token: bytes, user: str | None) -> None:
    assert claimed_user(mechanism, token) == user


def test_the_jwt_claim_is_the_one_the_brokers_take() -> None:
    token = (b"n,,\x01auth=Bearer " + jwt({"sub": "1f0c-88", "azp": "svc-orders"})
             + b"\x01\x01")
    assert claimed_user("OAUTHBEARER", token) == "1f0c-88"
    assert claimed_user("OAUTHBEARER", token, claim="azp") == "svc-orders"
    assert claimed_user("OAUTHBEARER", token, claim="client_id") is None  # not in it
    config = config_from_text("listen: 127.0.0.1:1\nupstream: [x:1]\n"
                              "sasl: {oauthbearer_sub_claim_name: azp}\n")
    assert config.oauthbearer_sub_claim == "azp"
    assert config_from_text("listen: 127.0.0.1:1\nupstream: [x:1]\n").oauthbearer_sub_claim \
        == "sub"
    with pytest.raises(ConfigError, match="must name a claim") as info:
        config_from_text("listen: 127.0.0.1:1\nupstream: [x:1]\nsasl:\n"
                         "  oauthbearer_sub_claim_name: ''\n", "proxy.yaml")
    assert str(info.value).startswith("proxy.yaml:4: ")


async def test_a_configured_claim_names_an_oauthbearer_client() -> None:
    """``sasl.oauthbearer_sub_claim_name`` reaches the connections: the principal is the
    claim the brokers were told to take."""
    def broker(req: codecs.Request) -> Any:
        if req.api_key == 17:
            return response_body(17, req.api_version, mechanisms=["OAUTHBEARER"])
        return response_body(36, req.api_version, error_code=0, auth_bytes=b"")

    token = b"n,,\x01auth=Bearer " + jwt({"sub": "1f0c-88", "azp": "alice"}) + b"\x01\x01"
    async with proxied(broker, oauthbearer_claim="azp") as h:
        await h.client.send(request(17, 1, 1, mechanism="OAUTHBEARER").encode())
        await h.client.send(request(36, 2, 2, auth_bytes=token).encode())
        with trio.fail_after(5):
            assert await h.client.receive() is not None
            assert await h.client.receive() is not None
        assert h.conn.principal == "alice"


def tenant_by_principal() -> RulesPolicy:
    rules = ("- name: alice\n  match: {principal: '^alice$'}\n"
             "  topic_prefix: {broker: 'alice.'}\n")
    return RulesPolicy(parse_rules(load_yaml_text(rules, "rules.yaml"), "rules.yaml"))


@pytest.mark.parametrize("accepted", [True, False])
async def test_a_principal_is_the_claimed_user_once_the_broker_accepts_it(
        accepted: bool) -> None:
    def broker(req: codecs.Request) -> Any:
        if req.api_key == 17:
            return response_body(17, req.api_version, mechanisms=["PLAIN"])
        if req.api_key == 36:
            return response_body(36, req.api_version, error_code=0 if accepted else
                                 SASL_AUTHENTICATION_FAILED, auth_bytes=b"")
        return response_body(3, req.api_version, brokers=[], topics=[
            {"name": t.name, "partitions": []} for t in req.body.topics or ()])

    async with proxied(broker, policy=tenant_by_principal()) as h:
        metadata = request(3, 12, 1, client_id="alice", topics=[{"name": "orders"}])
        await h.client.send(metadata.encode())  # before SASL: the rule does not apply
        await h.client.send(request(17, 1, 2, mechanism="plain").encode())
        await h.client.send(request(36, 2, 3, auth_bytes=b"\0alice\0secret").encode())
        with trio.fail_after(5):  # a client waits for its authentication's answer
            answers = [await h.client.receive() for _ in range(3)]
        await h.client.send(request(3, 12, 4, client_id="alice",
                                    topics=[{"name": "orders"}]).encode())
        with trio.fail_after(5):
            answers.append(await h.client.receive())
        assert all(a is not None for a in answers)
        assert h.conn.principal == ("alice" if accepted else None)
        asked = [codecs.decode_request(memoryview(f)) for f in h.broker.received]
        names = [[t.name for t in r.body.topics] for r in asked if r.api_key == 3]
        assert names == [["orders"], ["alice.orders" if accepted else "orders"]]
        last = codecs.decode_response(memoryview(answers[-1]), 3, 12)
        assert [t.name for t in last.body.topics] == ["orders"]  # named back
        assert "secret" not in repr(h.conn)  # the password is not kept


def test_the_census_counts_live_connections_per_principal() -> None:
    from gatehouse.metrics import ProxyMetrics
    from gatehouse.proxy.hooks import ConnectionInfo, Pending

    metrics = ProxyMetrics()

    def live(principal: str) -> float:
        value = metrics.registry.get_sample_value("gatehouse_principals",
                                                  {"principal": principal})
        return value or 0.0

    conns = [ConnectionInfo(id=i, client=f"127.0.0.1:{i}", listener="bootstrap")
             for i in (1, 2)]
    for conn in conns:
        metrics.connection_opened(conn)
        conn.principal = "alice"
        metrics.response(conn, Pending(1, 36, 2, 0.0), 10, 0.001)
    assert live("alice") == 2
    conns[1].principal = "bob"  # re-authenticated as another user (KIP-368)
    metrics.response(conns[1], Pending(2, 36, 2, 0.0), 10, 0.001)
    assert (live("alice"), live("bob")) == (1, 1)
    for conn in conns:
        metrics.connection_closed(conn, "client closed")
    assert (live("alice"), live("bob")) == (0, 0)
