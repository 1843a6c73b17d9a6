"""What proposed rules would do to the exchanges in a log: the proxy's own decision code.

A decision reads the client's facts (only those the rules look at: ``RuleSet.facts_read``),
the API key and version, and the topics named.  Spark reduces the log to the distinct
combinations of those columns and this module runs ``RuleSet.evaluate`` — the function the
proxy runs on every request — once per combination, inside Spark's Python workers
(``mapPartitions``: no pandas needed); the decisions are joined back to the log's groups.
Nothing of the rules is re-expressed in SQL, so the answer cannot drift from what the
proxy does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from gatehouse.codecs import Request
from gatehouse.rules import ClientFacts, RuleSet, TopicMap
from gatehouse.rules.topics import (
    GROUP,
    denial,
    denied_id_message,
    denied_message,
    filtered_id_kinds,
    id_denial,
)

# ClientFacts field -> the facts table's column that holds it (see job.facts_table).
FACT_COLUMN = {"client_id": "client_id", "software_name": "software_name",
               "software_version": "software_version", "address": "client",
               "listener": "listener", "principal": "principal"}
# What ``decide`` says of one combination, beside the combination's own columns.
DECISION_FIELDS: tuple[tuple[str, str], ...] = (
    ("rule", "string"), ("rule_index", "int"), ("action", "string"), ("effect", "string"),
    ("mode", "string"), ("reason", "string"), ("topics", "array<string>"),
)


def rewrites_topics(ruleset: RuleSet | None) -> bool:
    """Whether a rule maps topic names (only then do decisions read the topics named)."""
    return ruleset is not None and any(rule.maps_names for rule in ruleset.rules)


def filters_groups(ruleset: RuleSet | None) -> bool:
    """Whether a rule restricts the group ids clients may use (``allow_groups``...):
    only then do decisions read the group a request names."""
    return ruleset is not None and any(
        GROUP in filtered_id_kinds(m) for rule in ruleset.rules for m in rule.maps())


def decision_columns(ruleset: RuleSet) -> tuple[str, ...]:
    """The facts table's columns that decisions under ``ruleset`` depend on."""
    read = ruleset.facts_read()
    columns = [column for fact, column in FACT_COLUMN.items() if fact in read]
    columns += ["api_key", "api_version"]
    if rewrites_topics(ruleset):
        columns.append("topic_names")
    if filters_groups(ruleset):
        columns.append("group_id")
    return tuple(columns)


def decide(ruleset: RuleSet, row: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    """The refusals and rewrites ``ruleset`` makes for requests with these columns (a
    column the rules do not read may be absent), as ``DECISION_FIELDS`` tuples."""
    facts = ClientFacts(**{fact: row.get(column) for fact, column in FACT_COLUMN.items()})
    # Decisions read the header (API key and version) and the connection's facts; the
    # request body is not recorded, so it is not rebuilt.
    req = Request.build(row["api_key"], row["api_version"], 0, row.get("client_id"), None)
    evaluation = ruleset.evaluate(facts, req)
    reasons = {(r.rule, r.action): r.message
               for r in (evaluation.refusal, *evaluation.would_refuse) if r is not None}
    index = {rule.name: i for i, rule in enumerate(ruleset.rules)}
    maps: dict[str, TopicMap] = {r.name: m for r in ruleset.rules
                                 if (m := r.map_for(row["api_key"])) is not None}
    out: list[tuple[Any, ...]] = []
    for outcome in evaluation.outcomes:
        topics: list[str] = []
        if outcome.effect == "rewrite":
            topic_map = maps.get(outcome.rule)
            if topic_map is None:
                continue
            names = row.get("topic_names") or ()
            denied = [(name, why) for name in names
                      if (why := denial(topic_map, name)) is not None]
            if denied:  # a topic filter (allow_topics / deny_topics) refuses the request
                action = denied[0][1]
                out.append((outcome.rule, index.get(outcome.rule, -1), action, "refuse",
                            outcome.mode, denied_message(denied[0][0], outcome.rule),
                            [name for name, _ in denied]))
                continue
            group = row.get("group_id")
            why = id_denial(topic_map, GROUP, group) if group else None
            if group and why is not None:  # a group filter (allow_groups / deny_groups) refuses it
                out.append((outcome.rule, index.get(outcome.rule, -1), why, "refuse",
                            outcome.mode, denied_id_message(GROUP, group, outcome.rule), []))
                continue
            for name in names:
                broker = topic_map.to_broker(name)
                if broker != name:
                    topics.append(f"{name} -> {broker}")
            if not topics:
                continue  # the rule matches but this request names no topic it changes
        elif outcome.effect != "refuse":
            continue
        out.append((outcome.rule, index.get(outcome.rule, -1), outcome.action, outcome.effect,
                    outcome.mode, reasons.get((outcome.rule, outcome.action)), topics))
    return out


def evaluate_partition(ruleset: RuleSet, columns: tuple[str, ...]) -> Any:
    """A ``mapPartitions`` function: distinct rows of ``columns`` in, those columns followed
    by each decision's ``DECISION_FIELDS`` out."""

    def run(rows: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
        for row in rows:
            values = tuple(row[column] for column in columns)
            for decided in decide(ruleset, dict(zip(columns, values, strict=True))):
                yield values + decided

    return run
