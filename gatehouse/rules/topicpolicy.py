"""``topic_policy``: what the topics a client creates or changes must be (pure).

What brokers do with ``create.topic.policy.class.name`` and
``alter.config.policy.class.name`` (KIP-108, KIP-133): a Java class on every broker, the
cluster restarted to change it.  At the proxy it is a rule: names that follow the
platform's convention, partition counts and replication factors within bounds, topic
configs within bounds or from a list, configs a topic must be created with.

Held to it: CreateTopics (each topic: its name, partitions, replication factor, from
its replica assignments when it gives them, and its configs), CreatePartitions (each
topic's new partition count), AlterConfigs and IncrementalAlterConfigs (each topic
resource's configs; other resources are not topics).  As a broker's policy does, the
topics that break it are answered with POLICY_VIOLATION and a message saying what to
change, and the others go on: ``split`` makes the request to send on and the proxy's
answer for the rest, ``merged`` puts the broker's answer and the proxy's together.
``validate_only`` requests are held to it alike (the answer is the one the real
request would get).

A value the request leaves to the brokers' defaults (partitions or replication factor
-1, KIP-464; a config not given) is the platform's own choice and passes, unless a
config is ``required``.  ``-1`` is unlimited for the retention configs, so above any
``max``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from gatehouse.codecs import Request, Response
from gatehouse.rules.errors import POLICY_VIOLATION, array_entry, error_response, has_field
from gatehouse.rules.topics import TOPIC_RESOURCE

CREATE_TOPICS: Final = 19
ALTER_CONFIGS: Final = 33
CREATE_PARTITIONS: Final = 37
INCREMENTAL_ALTER_CONFIGS: Final = 44
POLICY_APIS: Final = frozenset({CREATE_TOPICS, ALTER_CONFIGS, CREATE_PARTITIONS,
                                INCREMENTAL_ALTER_CONFIGS})
# IncrementalAlterConfigs' operations (KIP-339).
_SET, _DELETE, _APPEND, _SUBTRACT = 0, 1, 2, 3
# Configs whose -1 means "no limit" (a max refuses it).
_UNLIMITED_AT_MINUS_ONE: Final = frozenset({"retention.ms", "retention.bytes",
                                            "local.retention.ms", "local.retention.bytes"})
# Each API's array of entries in its request and in its response.
_ENTRIES: Final = {CREATE_TOPICS: ("topics", "topics"),
                   CREATE_PARTITIONS: ("topics", "results"),
                   ALTER_CONFIGS: ("resources", "responses"),
                   INCREMENTAL_ALTER_CONFIGS: ("resources", "responses")}


@dataclass(frozen=True)
class Bound:
    """Inclusive bounds on a count; None: no bound that side."""

    min: int | None = None
    max: int | None = None

    def problem(self, what: str, value: int) -> str | None:
        if self.min is not None and value < self.min:
            return f"{what} {value} is below the minimum {self.min}"
        if self.max is not None and value > self.max:
            return f"{what} {value} is above the maximum {self.max}"
        return None


@dataclass(frozen=True)
class ConfigCheck:
    """What one topic config must be: a number within ``min``/``max``, one of
    ``allow`` (each item of a list config such as cleanup.policy), and whether a topic
    must be created with it (and may not lose it)."""

    name: str
    min: float | None = None
    max: float | None = None
    allow: frozenset[str] | None = None
    required: bool = False

    def problem(self, value: str | None) -> str | None:
        """What is wrong with ``value`` (None: the config removed, left to the default)."""
        if value is None:
            return f"config {self.name} is required" if self.required else None
        if self.allow is not None:
            items = [v.strip() for v in value.split(",")] if value.strip() else [""]
            for item in items:
                if item not in self.allow:
                    allowed = ", ".join(sorted(self.allow))
                    return f"config {self.name}={value} is not allowed (allowed: {allowed})"
        if self.min is not None or self.max is not None:
            try:
                number = float(value)
            except ValueError:
                return f"config {self.name}={value} is not a number"
            if number == -1 and self.name in _UNLIMITED_AT_MINUS_ONE:
                number = math.inf
            if self.min is not None and number < self.min:
                return f"config {self.name}={value} is below the minimum {_shown(self.min)}"
            if self.max is not None and number > self.max:
                limit = " (-1: unlimited)" if number == math.inf else ""
                return (f"config {self.name}={value}{limit} is above the maximum "
                        f"{_shown(self.max)}")
        return None


@dataclass(frozen=True)
class TopicPolicy:
    names: tuple[re.Pattern[str], ...] | None = None  # a new topic's name matches one
    partitions: Bound | None = None
    replication_factor: Bound | None = None
    configs: Mapping[str, ConfigCheck] = field(default_factory=dict)

    def entry_problem(self, api_key: int, entry: Any) -> str | None:
        """What one entry of a request of ``api_key`` breaks (None: nothing, or an entry
        that is not a topic's)."""
        if api_key == CREATE_TOPICS:
            return self._created(entry)
        if api_key == CREATE_PARTITIONS:
            return self._grown(entry)
        if entry.resource_type != TOPIC_RESOURCE:
            return None
        return self._altered(entry, api_key == INCREMENTAL_ALTER_CONFIGS)

    @property
    def judges_auto_creation(self) -> bool:
        """Whether a topic created on request could break it (``auto_creation_problem``):
        it has a naming rule or requires a config."""
        return self.names is not None or any(c.required for c in self.configs.values())

    def auto_creation_problem(self, name: str) -> str | None:
        """What a topic the brokers would create because a Metadata request asked for it
        (auto.create.topics.enable) breaks: its name, or a config the policy requires
        (such a topic takes the brokers' defaults, as CreateTopics' -1 counts and sizes
        do)."""
        problem = self._name_problem(name)
        if problem is None:
            required = sorted(c for c, check in self.configs.items() if check.required)
            if required:
                problem = (f"topic {name}: created on request it would have none of the "
                           f"configs required ({', '.join(required)})")
        return problem

    def _name_problem(self, name: str) -> str | None:
        if self.names is not None and not any(p.fullmatch(name) for p in self.names):
            patterns = ", ".join(p.pattern for p in self.names)
            return f"topic name {name!r} does not match the naming rule ({patterns})"
        return None

    def _created(self, topic: Any) -> str | None:
        name = topic.name
        problem = self._name_problem(name)
        if problem is not None:
            return problem
        assignments = topic.assignments or ()
        partitions = len(assignments) if assignments else topic.num_partitions
        replicas = (len(assignments[0].broker_ids) if assignments
                    else topic.replication_factor)
        for bound, what, value in ((self.partitions, "partition count", partitions),
                                   (self.replication_factor, "replication factor", replicas)):
            if bound is not None and value != -1:  # -1: the brokers' default
                problem = bound.problem(f"topic {name}: {what}", value)
                if problem is not None:
                    return problem
        problem = self._replica_sets_problem(
            name, assignments, lambda a: f"partition {a.partition_index}'s replication factor")
        if problem is not None:
            return problem
        given = {c.name: c.value for c in topic.configs or ()}
        return self._configs_problem(name, given)

    def _grown(self, topic: Any) -> str | None:
        """CreatePartitions: the topic's new partition count, and the replicas of the
        new partitions where it assigns them."""
        name = topic.name
        if self.partitions is not None:
            problem = self.partitions.problem(f"topic {name}: partition count", topic.count)
            if problem is not None:
                return problem
        return self._replica_sets_problem(name, topic.assignments or (),
                                          lambda _: "a new partition's replication factor")

    def _replica_sets_problem(self, name: str, assignments: Sequence[Any],
                              which: Callable[[Any], str]) -> str | None:
        """Replicas placed by hand: each partition's (``which`` names it) held to the
        replication factor bound."""
        if self.replication_factor is None:
            return None
        for assignment in assignments:
            problem = self.replication_factor.problem(f"topic {name}: {which(assignment)}",
                                                      len(assignment.broker_ids))
            if problem is not None:
                return problem
        return None

    def _altered(self, resource: Any, incremental: bool) -> str | None:
        name = resource.resource_name
        if not incremental:  # AlterConfigs: the configs given replace every other
            given = {c.name: c.value for c in resource.configs or ()}
            return self._configs_problem(name, given)
        for change in resource.configs or ():
            check = self.configs.get(change.name)
            if check is None:
                continue
            operation = change.config_operation
            if operation == _DELETE:
                problem = check.problem(None)
            elif operation == _SUBTRACT:
                problem = None  # fewer items of an allowed list stay allowed
            elif operation == _APPEND and check.allow is None:
                problem = None  # a bound on a number: appending to one is the broker's error
            else:
                problem = check.problem(change.value if change.value is not None else "")
            if problem is not None:
                return f"topic {name}: {problem}"
        return None

    def _configs_problem(self, name: str, given: Mapping[str, str | None]) -> str | None:
        """A topic's whole set of configs (created with, or replaced by, ``given``)."""
        for config, check in self.configs.items():
            if config in given or check.required:
                problem = check.problem(given.get(config))
                if problem is not None:
                    return f"topic {name}: {problem}"
        return None


def _shown(number: float) -> str:
    return str(int(number)) if number == int(number) else str(number)


def entries_of(req: Request) -> Sequence[Any]:
    """The request's topics (or config resources) that a policy judges one by one."""
    return getattr(req.body, _ENTRIES[req.api_key][0]) or ()


def split(req: Request, refused: Mapping[int, str]) -> tuple[Request | None, Response]:
    """``req`` without its ``refused`` entries (by position; None when none is left),
    and the proxy's answer for those: POLICY_VIOLATION with each one's message."""
    attr, answer_attr = _ENTRIES[req.api_key]
    entries = entries_of(req)
    kept = tuple(e for i, e in enumerate(entries) if i not in refused)
    mine = tuple(e for i, e in enumerate(entries) if i in refused)
    answer = error_response(req.replace(body=req.body.replace(**{attr: mine})),
                            POLICY_VIOLATION)
    entry = array_entry(req.api.response.root, answer_attr, req.api_version)
    if has_field(entry, "error_message", req.api_version):
        messages = [refused[i] for i in sorted(refused)]
        answered = getattr(answer.body, answer_attr)
        answer = answer.replace(body=answer.body.replace(**{answer_attr: tuple(
            e.replace(error_message=m) for e, m in zip(answered, messages, strict=True))}))
    rest = req.replace(body=req.body.replace(**{attr: kept})) if kept else None
    return rest, answer


def merged(resp: Response, answer: Response) -> Response:
    """The broker's answer ``resp`` with the proxy's ``answer`` for the entries it kept
    back added."""
    attr = _ENTRIES[resp.api_key][1]
    return resp.replace(body=resp.body.replace(**{attr: (
        *getattr(resp.body, attr), *getattr(answer.body, attr))}))


__all__ = [
    "POLICY_APIS",
    "Bound",
    "ConfigCheck",
    "TopicPolicy",
    "entries_of",
    "merged",
    "split",
]
