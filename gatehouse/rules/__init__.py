"""YAML rules and pure decisions over decoded messages (no trio, no I/O but reading files).

    ruleset = parse_rules(yaml_data, "rules.yaml")      # ConfigError with file:line
    evaluation = ruleset.evaluate(ClientFacts(...), request)
"""

from gatehouse.rules.errors import error_response
from gatehouse.rules.model import (
    ClientFacts,
    Evaluation,
    Match,
    Outcome,
    Refusal,
    Rule,
    RuleSet,
    VersionBound,
)
from gatehouse.rules.parse import load_rules_file, parse_rules
from gatehouse.rules.topics import (
    Chain,
    IdFilter,
    NameFilter,
    Prefix,
    Rename,
    RewriteStats,
    TopicFilter,
    TopicMap,
    map_request,
    map_request_head,
    map_response,
)

__all__ = [
    "Chain",
    "ClientFacts",
    "Evaluation",
    "IdFilter",
    "Match",
    "NameFilter",
    "Outcome",
    "Prefix",
    "Refusal",
    "Rename",
    "RewriteStats",
    "Rule",
    "RuleSet",
    "TopicFilter",
    "TopicMap",
    "VersionBound",
    "error_response",
    "load_rules_file",
    "map_request",
    "map_request_head",
    "map_response",
    "parse_rules",
]
