"""What proposed rules would do to the exchanges in a log: the proxy's own decision code.

Spark groups the log by everything a decision can depend on (client facts, API key and
version, the topics named) and this module runs ``RuleSet.evaluate`` — the function the
proxy runs on every request — once per group, inside Spark's Python workers
(``mapPartitions``: no pandas needed).  Nothing
of the rules is re-expressed in SQL, so the answer cannot drift from what the proxy does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from gatehouse.codecs import Request
from gatehouse.rules import ClientFacts, RuleSet, TopicMap

# The columns the grouped log hands to ``evaluate_groups`` (see job.impact_table).
FACT_COLUMNS = ("client_id", "software_name", "software_version", "client", "listener",
                "api", "api_key", "api_version", "topic_names")
IMPACT_FIELDS: tuple[tuple[str, str], ...] = (
    ("rule", "string"), ("rule_index", "int"), ("action", "string"), ("effect", "string"),
    ("mode", "string"), ("reason", "string"), ("client_id", "string"),
    ("software_name", "string"), ("software_version", "string"), ("client", "string"),
    ("listener", "string"), ("api", "string"), ("api_version", "int"),
    ("topics", "array<string>"), ("requests", "double"), ("first_seen", "double"),
    ("last_seen", "double"),
)
_SQL = {"string": "STRING", "int": "INT", "double": "DOUBLE", "array<string>": "ARRAY<STRING>"}
IMPACT_DDL = ", ".join(f"{name} {_SQL[kind]}" for name, kind in IMPACT_FIELDS)


def decide(ruleset: RuleSet, row: dict[str, Any]) -> list[dict[str, Any]]:
    """The refusals and rewrites ``ruleset`` makes for one group of identical requests."""
    facts = ClientFacts(client_id=row["client_id"], software_name=row["software_name"],
                        software_version=row["software_version"], address=row["client"],
                        listener=row["listener"])
    # Decisions read the header (API key and version) and the connection's facts; the
    # request body is not recorded, so it is not rebuilt.
    req = Request.build(row["api_key"], row["api_version"], 0, row["client_id"], None)
    evaluation = ruleset.evaluate(facts, req)
    reasons = {(r.rule, r.action): r.message
               for r in (evaluation.refusal, *evaluation.would_refuse) if r is not None}
    index = {rule.name: i for i, rule in enumerate(ruleset.rules)}
    maps: dict[str, TopicMap] = {r.name: r.topic_map for r in ruleset.rules
                                 if r.topic_map is not None}
    out = []
    for outcome in evaluation.outcomes:
        topics: list[str] = []
        if outcome.effect == "rewrite":
            topic_map = maps.get(outcome.rule)
            if topic_map is None:
                continue
            for name in row["topic_names"] or ():
                broker = topic_map.to_broker(name)
                if broker != name:
                    topics.append(f"{name} -> {broker}")
            if not topics:
                continue  # the rule matches but this request names no topic it changes
        elif outcome.effect != "refuse":
            continue
        out.append({
            "rule": outcome.rule, "rule_index": index.get(outcome.rule, -1),
            "action": outcome.action, "effect": outcome.effect, "mode": outcome.mode,
            "reason": reasons.get((outcome.rule, outcome.action)),
            **{k: row[k] for k in ("client_id", "software_name", "software_version", "client",
                                   "listener", "api", "api_version")},
            "topics": topics, "requests": row["requests"], "first_seen": row["first_seen"],
            "last_seen": row["last_seen"],
        })
    return out


def evaluate_partition(ruleset: RuleSet) -> Any:
    """A ``mapPartitions`` function: fact groups (Rows) in, impact rows (tuples) out."""
    names = [name for name, _ in IMPACT_FIELDS]

    def run(rows: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
        for row in rows:
            for decided in decide(ruleset, row.asDict()):
                yield tuple(decided[name] for name in names)

    return run
