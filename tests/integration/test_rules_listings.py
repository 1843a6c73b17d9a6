"""Listings of the whole cluster under a tenant's prefix with ``hide_others``, on a real
Apache Kafka broker, asked with the protocol's own requests: ListConfigResources
(KIP-1142) and DescribeTopicPartitions of every topic, a page at a time (KIP-966).  The
tenant sees all of its own, without the prefix, and nothing of another's."""

from __future__ import annotations

from pathlib import Path

from tests.integration.test_rules_groups import RULES
from tests.integration.test_rules_topic_ids import call
from tests.support.clients import unique
from tests.support.kafka import KafkaCluster
from tests.support.proxythread import ProxyThread


def test_list_config_resources_shows_a_tenant_only_its_own(kafka: KafkaCluster) -> None:
    """ListConfigResources (KIP-1142) lists every topic on the cluster: under the prefix,
    the tenant sees its own without the prefix and none of another's (the entries
    dropped, not left as holes the answer cannot be written with)."""
    mine, theirs = unique("a.configs"), unique("b.configs")
    for topic in (mine, theirs):
        kafka.create_topic(topic)
    body = {"resource_types": [2]}
    direct = call(kafka.bootstrap, 74, 1, body, client_id="ops")
    assert {(2, mine), (2, theirs)} <= {(r.resource_type, r.resource_name)
                                         for r in direct.config_resources}
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        seen = call(proxy.bootstrap, 74, 1, body)  # client id a-raw: the tenant
        other = call(proxy.bootstrap, 74, 1, body, client_id="ops")  # no rule: all
    assert seen.error_code == 0
    names = {r.resource_name for r in seen.config_resources}
    assert mine.removeprefix("a.") in names
    # Only the tenant's own topics, without the prefix (another test's a.b.x is its
    # own b.x: a b. name alone tells nothing).
    owns = {r.resource_name.removeprefix("a.") for r in direct.config_resources
            if r.resource_name.startswith("a.")}
    assert names <= owns and theirs not in names, names - owns
    assert {r.resource_name for r in other.config_resources} >= {mine, theirs}


def pages(address: str, client_id: str, cursors: list[str] | None = None
          ) -> tuple[list[str], int]:
    """DescribeTopicPartitions of every topic, two partitions a page, to the end: the
    topics named (in order, once each) and the number of pages; each cursor's topic
    added to ``cursors``."""
    names: list[str] = []
    cursor = None
    for count in range(1, 1000):
        body = call(address, 75, 0, {"topics": [], "response_partition_limit": 2,
                                     "cursor": cursor}, client_id=client_id)
        names.extend(t.name for t in body.topics if t.name not in names)
        if body.next_cursor is None:
            return names, count
        cursor = {"topic_name": body.next_cursor.topic_name,
                  "partition_index": body.next_cursor.partition_index}
        if cursors is not None:
            cursors.append(body.next_cursor.topic_name)
    raise AssertionError("the listing never ended")


def test_every_topic_a_page_at_a_time_is_the_tenants_own(kafka: KafkaCluster) -> None:
    """DescribeTopicPartitions of every topic, two partitions a page: through the
    proxy the pages start at the tenant's prefix and end after its last topic (a cursor
    at another tenant's topic ends the listing, never names it); directly, the same
    pages hold everyone's."""
    tag = unique("list").replace("-", "")
    mine = sorted(f"a.{tag}.{n}" for n in ("one", "two", "three"))
    theirs = [f"0.{tag}", f"b.{tag}", f"z.{tag}"]  # before and after the prefix's topics
    # Whatever else the broker holds, the first pages hold another tenant's partitions
    # only: four of them sort before every topic here but __consumer_offsets ("." < "_").
    first = f"-.{tag}"
    theirs.append(first)
    kafka.create_topic(first, partitions=4)
    for topic in (*mine, *theirs[:-1]):
        kafka.create_topic(topic, partitions=2 if topic.endswith("two") else 1)

    direct, _ = pages(kafka.bootstrap, "ops")
    assert set(mine) | set(theirs) <= set(direct)
    with ProxyThread(kafka.bootstrap, rules_yaml=RULES) as proxy:
        seen, count = pages(proxy.bootstrap, "a-raw")
    own = sorted(n.removeprefix("a.") for n in direct if n.startswith("a."))
    assert sorted(seen) == own and {n.removeprefix("a.") for n in mine} <= set(seen)
    assert count >= 2  # it took more than one page


def test_every_topic_under_a_filter_goes_on_past_hidden_topics(kafka: KafkaCluster) -> None:
    """Under deny_topics, a listing of every topic whose pages hold denied topics only
    (five in a row, one of three partitions: a cursor inside it) goes on to the end by
    the proxy's sealed cursors: every allowed topic is listed, no denied one, and no
    cursor names one.  A cursor the client makes up is refused: no topics, no cursor
    (the broker, asked directly, answers it with its page)."""
    tag = unique("seal").replace("-", "")
    hidden = [f"{tag}.hidden.{n}" for n in range(5)]
    shown = [f"{tag}.before", f"{tag}.zafter"]  # the hidden ones between them
    for topic in (*hidden, *shown):
        kafka.create_topic(topic, partitions=3 if topic.endswith(".2") else 1)
    rules = (f"- name: no-hidden\n  match: {{client_id: '^filtered$'}}\n"
             f"  deny_topics: ['{tag}\\.hidden\\..*']\n")
    direct, _ = pages(kafka.bootstrap, "ops")
    assert set(hidden) | set(shown) <= set(direct)
    cursors: list[str] = []
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        seen, count = pages(proxy.bootstrap, "filtered", cursors)
        made_up = call(proxy.bootstrap, 75, 0, {
            "topics": [], "response_partition_limit": 2,
            "cursor": {"topic_name": shown[0], "partition_index": 0}}, client_id="filtered")
    assert seen == [n for n in direct if f"{tag}.hidden." not in n]  # all, in order
    assert set(shown) <= set(seen)
    assert count >= 4 and len(cursors) == count - 1  # pages of hidden topics passed
    assert not [c for c in cursors if tag in c or not c.startswith("~gatehouse:")]
    assert made_up.topics == () and made_up.next_cursor is None
    asked = call(kafka.bootstrap, 75, 0, {
        "topics": [], "response_partition_limit": 2,
        "cursor": {"topic_name": shown[0], "partition_index": 0}}, client_id="ops")
    assert shown[0] in [t.name for t in asked.topics]


def test_the_java_topic_command_describes_through_a_filter_page_by_page(
        kafka: KafkaCluster, tmp_path: Path) -> None:
    """Kafka's TopicCommand lists the topics (Metadata) and describes them by name with
    DescribeTopicPartitions, a page of --partition-size-limit-per-response partitions
    at a time (its cursor at one of the topics it named): through a filter it describes
    every partition of the allowed topics, and nothing of the denied one."""
    tag = unique("jdesc").replace("-", "")
    shown, denied = [f"{tag}.a", f"{tag}.b"], f"{tag}.hidden"
    for topic in (*shown, denied):
        kafka.create_topic(topic, partitions=3)
    rules = (f"- name: no-hidden\n  match: {{client_id: '^filtered$'}}\n"
             f"  deny_topics: ['{tag}\\.hidden']\n")
    settings = tmp_path / "admin.properties"
    settings.write_text("client.id=filtered\n")
    with ProxyThread(kafka.bootstrap, rules_yaml=rules) as proxy:
        java = kafka.run_java_tool(
            "org.apache.kafka.tools.TopicCommand", "--bootstrap-server", proxy.bootstrap,
            "--command-config", str(settings), "--describe", "--topic", f"{tag}\\..*",
            "--partition-size-limit-per-response", "2", timeout=120)
    assert java.returncode == 0, java.stderr[-2000:]
    described = [(line.split("Topic: ")[1].split()[0], line.split("Partition: ")[1].split()[0])
                 for line in java.stdout.splitlines() if "Partition: " in line]
    assert sorted(described) == sorted((t, str(p)) for t in shown for p in range(3))
    assert denied not in java.stdout
