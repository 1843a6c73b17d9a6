"""The rules, wired into the connection pumps: refusals, topic maps, ApiVersions, reload."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from gatehouse.codecs import (
    API_KEYS_BY_NAME,
    APIS,
    KAFKA_RELEASE,
    Request,
    Response,
    api_name,
    produce,
)
from gatehouse.compression import DecompressionError, compress_gzip, compress_zstd, decompress
from gatehouse.configfile import ConfigError, FileWatch, load_yaml_file
from gatehouse.logs import log_event
from gatehouse.proxy.apiversions import RangeAdjuster
from gatehouse.proxy.hooks import (
    Close,
    ConnectionInfo,
    Decision,
    Forward,
    Pending,
    Policy,
    Respond,
    scanned_response,
)
from gatehouse.proxy.kms import KmsClients
from gatehouse.proxy.quotas import Charge, QuotaBuckets
from gatehouse.proxy.registry import SchemaRegistries
from gatehouse.rules import (
    ClientFacts,
    Evaluation,
    Outcome,
    RewriteStats,
    RuleSet,
    TopicFilter,
    TopicMap,
    error_response,
    map_request,
    map_request_head,
    map_response,
    parse_rules,
)
from gatehouse.rules.acl import names_cluster_configs
from gatehouse.rules.encryption import (
    Kek,
    KmsUnavailable,
    OpenedAnswer,
    RecordCipher,
    SealedRequest,
    answer_may_hold,
    open_answer,
    seal_request,
    sealing_keks,
)
from gatehouse.rules.errors import (
    GROUP_AUTHORIZATION_FAILED,
    INVALID_REQUEST,
    REQUEST_TIMED_OUT,
    TOPIC_AUTHORIZATION_FAILED,
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    UNKNOWN_TOPIC_ID,
)
from gatehouse.rules.produce import (
    UNSEEN_ID,
    IdNames,
    client_topic_names,
    partition_place,
    produce_violation,
    topic_key,
)
from gatehouse.rules.records import (
    Lookup,
    PartitionKey,
    PartitionVerdict,
    RecordValidation,
    RegisteredSchema,
    RegistryCheck,
    SchemaLookup,
    merged,
    verdict,
    withheld_answer,
    without,
)
from gatehouse.rules.topicids import TopicIds, checks_ids, request_ids, teaches_ids
from gatehouse.rules.topicpolicy import entries_of
from gatehouse.rules.topicpolicy import merged as merged_by_policy
from gatehouse.rules.topicpolicy import split as split_by_policy
from gatehouse.rules.topics import (
    FIND_COORDINATOR,
    GROUP,
    ID_FILTER_KEYS,
    TOPIC,
    TRANSACTION,
    answer_hint,
    asks_auto_creation,
    carries_ids,
    carries_topics,
    cursor_refusal,
    denial,
    denied_id_message,
    denied_message,
    filtered_id_kinds,
    has_error_text,
    id_denial,
    id_names,
    lookup_kind,
    map_parts,
    names_ids,
    names_resources,
    names_topics,
    reach_outside,
    regex_subscription,
    topic_names,
)
from gatehouse.rules.withhold import (
    NAME_ATTRS,
    WHOLE,
    EntryTest,
    denied_ids,
    denied_topics,
    split,
    unshown_ids,
)
from gatehouse.rules.withhold import answer as answer_entries
from gatehouse.rules.withhold import merged as merged_entries

logger = logging.getLogger("gatehouse.rules")
PRODUCE, FETCH, METADATA = 0, 1, 3
_FOREIGN_ID = "names by id a topic outside the client's prefix"
# The context of a request forwarded only for its answer's topic ids (``on_response``).
_LEARN_IDS = object()
# Produce requests from this size on have their records read in a thread (``offload``).
_OFFLOAD_BYTES = 64 * 1024
# encrypt_records: the answers whose records are opened, and what ``offload`` and
# ``offload_response`` leave in a connection's state for on_request and on_response.
_OPENED_ANSWERS = frozenset((FETCH, API_KEYS_BY_NAME["ShareFetch"]))
_SEALED = "encrypt_records.sealed"
_OPENED = "encrypt_records.opened"
_UNDECRYPTABLE_LOG_EVERY = 60.0  # seconds between "records not decrypted" lines per topic
_UNDECRYPTABLE_LOGGED_MAX = 10_000  # (rule, topic) pairs remembered for it
# The verdict on the partitions of a topic named by an id not learned yet (rules.records).
_UNSEEN_ID = PartitionVerdict(UNKNOWN_TOPIC_ID, UNSEEN_ID)
# What a broker answers a client its ACLs do not allow to use the name.
_NOT_AUTHORIZED = {TOPIC: TOPIC_AUTHORIZATION_FAILED, GROUP: GROUP_AUTHORIZATION_FAILED,
                   TRANSACTION: TRANSACTIONAL_ID_AUTHORIZATION_FAILED}


def _wants_mapped_answer(req: Request, topic_map: TopicMap) -> bool:
    """Whether the answer to ``req``, whose topics (maybe group and transactional ids)
    a rule maps, is to be decoded: only if this version of it names them, or may quote
    them in error text (not Fetch v13+: ids only, and its large answers stream on)."""
    response, version = req.api.response, req.api_version
    if (names_topics(response, version) or req.api_key in (11, 14, 15)
            or (carries_topics(response) and has_error_text(response, version))):
        return True
    kinds = topic_map.id_kinds
    if not kinds:
        return False
    if req.api_key == FIND_COORDINATOR:  # v4+ answers name the keys they answer
        return version >= 4 and lookup_kind(req) in kinds
    return names_ids(response, version, kinds) or (carries_ids(response, kinds)
                                                   and has_error_text(response, version))


def facts_of(conn: ConnectionInfo, req: Request | None = None) -> ClientFacts:
    client_id = req.header.client_id if req is not None else conn.client_id
    # The same facts, request after request, on a connection: built once while they hold.
    facts = conn.state.get("facts")
    if (facts is None or facts.client_id != client_id
            or facts.software_name != conn.software_name
            or facts.software_version != conn.software_version
            or facts.principal != conn.principal):
        facts = conn.state["facts"] = ClientFacts(
            client_id=client_id, software_name=conn.software_name,
            software_version=conn.software_version, address=conn.client,
            listener=conn.listener, principal=conn.principal)
    return facts


_MAX_EVALUATIONS = 1024  # per connection: API versions a client uses (a few dozen)


def _evaluated(ruleset: RuleSet, facts: ClientFacts, req: Request,
               state: dict[str, Any]) -> Evaluation:
    """``ruleset.evaluate``, remembered per connection: the evaluation depends only on
    the rules, the client's facts and the API key and version, and a client sends the
    same few of those again and again."""
    memo = state.get("evaluations")
    if memo is None or memo[0] is not ruleset or memo[1] is not facts:
        memo = state["evaluations"] = (ruleset, facts, {})
    known: dict[int, Evaluation] = memo[2]
    slot = (req.api_key << 16) | (req.api_version & 0xFFFF)
    evaluation = known.get(slot)
    if evaluation is None:
        if len(known) >= _MAX_EVALUATIONS:
            known.clear()
        evaluation = known[slot] = ruleset.evaluate(facts, req)
    return evaluation


class RulesPolicy(Policy):
    """Applies a RuleSet; ``ruleset`` can be swapped at any time (hot reload)."""

    def __init__(self, ruleset: RuleSet) -> None:
        self.ruleset = ruleset
        self.stats = RewriteStats()
        # Topic ids learned from answers, checked under a prefix that hides others'.
        self.topic_ids = TopicIds()
        self.outcome_listeners: list[Callable[[Outcome], None]] = []
        # Quotas: the shared buckets (kept across reloads), and who hears of a hold
        # (rule, seconds held).
        self.quota_buckets = QuotaBuckets()
        self.throttle_listeners: list[Callable[[str, float], None]] = []
        self.refusal_listeners: list[Callable[[ConnectionInfo, Request, str, str], None]] = []
        # Who hears of records validate_records found invalid: (rule, topic as the
        # client names it, mode, how many).
        self.invalid_records_listeners: list[Callable[[str, str, str, int], None]] = []
        # The schemas validate_records' registry checks look up (kept across reloads).
        self.schemas = SchemaRegistries()
        # encrypt_records' data keys (kept across reloads: a key file's keys stay), and
        # who hears how many records were encrypted or decrypted, or did not decrypt:
        # (rule, topic as the client names it, outcome, how many).
        self.cipher = RecordCipher()
        self.kms = KmsClients()
        self.encryption_listeners: list[Callable[[str, str, str, int], None]] = []
        # (message, rule, topic) -> when records not decrypted (or not sealed for want
        # of a KMS) were last logged, and how many since (logged with the next line).
        self._undecryptable_logged: dict[tuple[str, ...], tuple[float, int]] = {}
        # The rules and, per client facts, their ApiVersions adjusters.
        self._adjusters: tuple[RuleSet | None, dict[ClientFacts, tuple[RangeAdjuster, ...]]] = (
            None, {})

    def _emit(self, outcomes: tuple[Outcome, ...]) -> None:
        for listener in self.outcome_listeners:
            for outcome in outcomes:
                listener(outcome)

    def on_request(self, conn: ConnectionInfo, req: Request) -> Decision:
        ruleset = self.ruleset  # one snapshot for the whole request
        if not ruleset:
            return Forward(req)
        evaluation = _evaluated(ruleset, facts_of(conn, req), req, conn.state)
        # What ``offload``'s work found for this request (never held past it).
        offloaded = conn.state.pop("record_verdicts", None)
        sealed_found = conn.state.pop(_SEALED, None)
        refused = (self._refused_cluster_configs(conn, req, evaluation)
                   or self._refused_produce(conn, req, evaluation))
        # What is sent on without some of its topics (partitions), with the proxy's
        # answer for those, in the order they were taken out.
        withheld: list[_Withholding] = []
        for check in (self._refused_ids, self._refused_topics):
            if refused is not None:
                break
            found = check(conn, req, evaluation, ruleset)
            if isinstance(found, list):
                withheld.extend(found)
                req = found[-1].rest
                evaluation = dataclasses.replace(evaluation, outcomes=found[-1].outcomes)
            else:
                refused = found
        outcomes = evaluation.outcomes
        if refused is None and (evaluation.record_validations or evaluation.records_observed):
            checked = self._checked_records(
                conn, req, evaluation,
                offloaded[1] if offloaded is not None and offloaded[0] is req else {})
            if isinstance(checked, _Withholding):
                req, outcomes = checked.rest, checked.outcomes
                withheld.append(checked)
            else:
                refused = checked
        elif refused is None and (evaluation.topic_policies
                                  or evaluation.topic_policies_observed):
            held = self._checked_topic_policy(conn, req, evaluation)
            if isinstance(held, _Withholding):
                req, outcomes = held.rest, held.outcomes
                withheld.append(held)
            else:
                refused = held
        if (refused is None and evaluation.encryptions and req.api_key == PRODUCE
                and req.known and evaluation.refusal is None):
            sealing = self._sealed(conn, req, evaluation, outcomes,
                                   sealed_found[1] if sealed_found is not None
                                   and sealed_found[0] is req else None)
            if isinstance(sealing, _Withholding):
                req, outcomes = sealing.rest, sealing.outcomes
                withheld.append(sealing)
            elif isinstance(sealing, Request):
                req = sealing
            else:
                refused = sealing
        self._emit(outcomes if refused is None else refused[1])
        observed = evaluation.observed_map
        if observed is not None and observed.filters:
            self._emit(self._would_refuse_topics(conn, req, evaluation, ruleset))
        if observed is not None and observed.hides_others:
            self._emit(self._would_refuse_ids(conn, req, evaluation, ruleset))
        for refusal in evaluation.would_refuse:
            self._log_refusal(conn, req, refusal.rule, refusal.message, observe=True)
        if refused is not None:
            return _with_withheld(refused[0], withheld)
        if evaluation.refusal is not None:
            refusal = evaluation.refusal
            self._log_refusal(conn, req, refusal.rule, refusal.message, observe=False)
            if not req.known:
                return Close(f"refused {api_name(req.api_key)} v{req.api_version} ({refusal.message}); "
                             "the codec has no table for that version to build its error "
                             "response, so the connection is closed")
            return _refused(req, refusal.message, refusal.code, refusal.message)
        decision = self._forwarded(conn, req, evaluation, ruleset)
        if (evaluation.encryptions and req.api_key in _OPENED_ANSWERS
                and isinstance(decision, Forward) and answer_may_hold(
                    req, evaluation.encryptions, self._id_names(evaluation))):
            # Its answer's records are opened for the client (``on_response``).
            decision = dataclasses.replace(decision, wants_response=True, context=_Opening(
                decision.context if decision.wants_response else None, evaluation))
        return _with_withheld(decision, withheld)

    def refuses_unread(self, conn: ConnectionInfo, req: Request) -> str | None:
        ruleset = self.ruleset
        if not ruleset or req.api_key in _NEVER_READ:
            return None
        evaluation = _evaluated(ruleset, facts_of(conn, req), req, conn.state)
        # Enforced parts only: observe mode never breaks traffic.
        why = ("the rules refuse it" if evaluation.refusal is not None
               else "the rules map or filter the names in it" if evaluation.topic_map
               else "the rules' cluster ACLs read its config resources"
               if evaluation.config_refusal is not None
               else "the rules read its records" if (evaluation.produce_policies
                                                     or evaluation.record_validations)
               else "the rules hold its topics to a topic_policy" if evaluation.topic_policies
               else "the rules encrypt its records" if evaluation.encryptions
               else None)
        if why is None:
            return None
        spec = APIS.get(req.api_key)
        what = (f"API key {req.api_key} is not in" if spec is None
                else f"{api_name(req.api_key)} v{req.api_version} is "
                     f"{'older' if req.api_version < spec.versions.lo else 'newer'} than")
        return (f"{what} the proxy's tables (Kafka {KAFKA_RELEASE}) and {why}: it cannot go "
                "on unread (the client was offered only the APIs and versions the proxy "
                "reads, in ApiVersions)")

    def _forwarded(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation,
                   ruleset: RuleSet) -> Decision:
        """A request no rule refused, forwarded: mapped under a topic map, sent for its
        answer where the answer needs mapping or teaches topic ids."""
        observed = evaluation.observed_map
        if evaluation.observed_map is not None and req.known:
            try:
                changed = map_request(req, evaluation.observed_map, {}, RewriteStats())
            except Exception:  # observe mode must never break traffic
                changed = req
            if changed is not req:
                log_event(logger, logging.DEBUG, "would rewrite topic names", **conn.describe(),
                          api=req.api.name)
        topic_map = evaluation.topic_map
        if topic_map is None:
            if ((ruleset.scopes_produce_by_topic
                 or (observed is not None and observed.hides_others))
                    and teaches_ids(req.api.response, req.api_version)):
                # Its answer teaches topic ids, which the observe-mode id check and
                # produce rules limited to some topics (Produce v13 names topics by
                # id) read.
                return Forward(req, wants_response=True, context=_LEARN_IDS)
            return Forward(req)
        regex = regex_subscription(req)
        message = (None if regex is None else
                   f"regex subscription {regex!r} cannot be rewritten safely under topic "
                   "renames/prefixes; subscribe to topic names instead")
        message = message or reach_outside(req, topic_map)
        if message is not None:
            self._log_refusal(conn, req, "topic-map", message, observe=False)
            return Respond(error_response(req, INVALID_REQUEST, message))
        mapped = map_request(req, topic_map, conn.state, self.stats)
        wants = _wants_mapped_answer(req, topic_map)
        hint = answer_hint(req) if wants else None
        if hint is not None:
            # The answer does not say what kind of keys it answers (FindCoordinator), or
            # that it lists every topic (DescribeTopicPartitions): the request does.
            return Forward(mapped, wants_response=True, context=(topic_map, hint))
        return Forward(mapped, wants_response=wants, context=topic_map)

    def forwards_unread(self, conn: ConnectionInfo, req: Request) -> Forward | None:
        ruleset = self.ruleset
        if not ruleset:
            return Forward(req)
        if ruleset.has_quotas and ruleset.quotas(facts_of(conn, req)):
            return None  # spent from and held back whole (on_request's path)
        # The evaluation reads the header only.  A rule that refuses or would refuse
        # wants the whole request (on_request); so does a topic map, unless the
        # request's one topic name is in the bytes at hand (Produce, as librdkafka
        # and the Java producer send it to a broker for one topic).
        evaluation = _evaluated(ruleset, facts_of(conn, req), req, conn.state)
        if (evaluation.refusal is not None or evaluation.would_refuse
                or evaluation.observed_map is not None or evaluation.reads_produce
                or evaluation.topic_policies or evaluation.topic_policies_observed):
            return None  # produce_policy, validate_records, topic_policy: read it whole
        if ruleset.scopes_produce_by_topic and teaches_ids(req.api.response, req.api_version):
            return None  # its answer teaches the ids rules limited to some topics match by
        topic_map = evaluation.topic_map
        report = partial(self._emit, evaluation.outcomes)
        if topic_map is None:
            return Forward(req, report=report)
        if topic_map.filters and _filters_names_in(req, topic_map):
            return None  # the names it holds are checked in the whole request
        new_head = None
        by_name = names_topics(req.api.request, req.api_version)
        if by_name or TRANSACTION in topic_map.id_kinds:
            new_head = map_request_head(req, topic_map)  # names and transactional id
            if new_head is None:
                return None
        if (not by_name and topic_map.hides_others
                and not self.topic_ids.head_shown(req, topic_map)):
            return None  # names a topic by an id to check: checked whole (on_request)
        return Forward(req, wants_response=_wants_mapped_answer(req, topic_map),
                       context=topic_map, new_head=new_head, report=report)

    def on_response(self, conn: ConnectionInfo, pending: Pending, resp: Response) -> Response:
        context = pending.context
        answers: list[_Withheld] = []
        while isinstance(context, _Withheld):
            answers.append(context)
            context = context.inner
        if isinstance(context, _Opening):
            # The broker's answer opened (by ``offload_response``'s work if it did it),
            # then mapped as any other.
            found = conn.state.pop(_OPENED, None)
            opened = (found[1] if found is not None and found[0] is resp
                      else self._open(resp, context.evaluation, block=False))
            resp = self._count_opened(opened)
            context = context.inner
        resp = self._answered(conn, pending, context, resp)
        for withheld in reversed(answers):  # in the order the entries were taken out
            resp = withheld.merge(resp, withheld.answer)
        return resp

    def _answered(self, conn: ConnectionInfo, pending: Pending, context: Any,
                  resp: Response) -> Response:
        """The broker's answer as the client gets it, for a request forwarded with
        ``context`` (a topic map, what a FindCoordinator looked up, ``_LEARN_IDS``)."""
        topic_map, lookup = context, None
        if topic_map is _LEARN_IDS:
            self.topic_ids.learn(resp)
            return resp
        if isinstance(topic_map, tuple):  # (map, its request's answer_hint)
            topic_map, lookup = topic_map
        if not isinstance(topic_map, TopicMap):
            return resp
        if ((topic_map.hides_others or _observes_ids(self.ruleset)
             or self.ruleset.scopes_produce_by_topic)
                and teaches_ids(resp.api.response, resp.api_version)):
            # Broker-side names, before they are mapped: read by a map that hides other
            # tenants' topics, enforced or observed, and by produce rules limited to
            # some topics (Produce v13 names topics by id).
            self.topic_ids.learn(resp)
        if pending.api_key == PRODUCE and not names_topics(resp.api.response, resp.api_version):
            # Produce v13 names topics by id: only error text could need mapping, and the
            # proxy's reading of the bytes says whether there is any.
            scan = scanned_response(pending, resp.frame)
            if scan is not None and not scan[2]:
                return resp
        return map_response(resp, topic_map, conn.state, self.stats, lookup)

    def quota_charges(self, conn: ConnectionInfo, now: float) -> tuple[Charge, ...]:
        """The quotas of the rules that match the connection, with its buckets; the same
        tuple while the rules and the client's facts hold."""
        ruleset = self.ruleset
        if not ruleset.has_quotas:
            return ()
        facts = facts_of(conn)
        memo = conn.state.get("quotas")
        if memo is not None and memo[0] is ruleset and memo[1] is facts:
            return memo[2]  # type: ignore[no-any-return]
        charges = self.quota_buckets.charges(ruleset.quotas(facts), facts, conn.id, now)
        conn.state["quotas"] = (ruleset, facts, charges)
        return charges

    def throttled(self, conn: ConnectionInfo, charge: Charge, seconds: float,
                  held: bool) -> None:
        self._emit((Outcome(charge.rule, "quota", "throttle", charge.mode),))
        if held:
            for listener in self.throttle_listeners:
                listener(charge.rule, seconds)
        # Logged once per connection and rule: a throttled client is throttled often.
        logged = conn.state.setdefault("throttle_logged", set())
        if charge.rule not in logged:
            logged.add(charge.rule)
            log_event(logger, logging.INFO, "quota: holding the client's requests back"
                      if held else "quota: would hold the client's requests back (observe "
                      "mode)", **conn.describe(), rule=charge.rule, kind=charge.kind,
                      rate=charge.rate, seconds=round(seconds, 3))

    def api_version_adjusters(self, conn: ConnectionInfo) -> tuple[RangeAdjuster, ...]:
        """The same tuple for the same rules and client facts: the proxy reuses a capped
        ApiVersions answer per adjusters (by identity)."""
        ruleset = self.ruleset
        if not ruleset:
            return ()
        facts = facts_of(conn)
        rules, known = self._adjusters
        if rules is not ruleset:
            known = {}
            self._adjusters = (ruleset, known)
        found = known.get(facts)
        if found is None:
            def adjust(api_key: int, lo: int, hi: int) -> tuple[int, int] | None:
                return ruleset.version_ranges(facts, api_key, lo, hi)

            if len(known) >= _MAX_EVALUATIONS:
                known.clear()
            found = known[facts] = (adjust,)
        return found

    def _refused_cluster_configs(self, conn: ConnectionInfo, req: Request,
                                 evaluation: Evaluation
                                 ) -> tuple[Decision, tuple[Outcome, ...]] | None:
        """A config API's request that names the cluster's configs (a broker's, say)
        where a rule's cluster ACLs do not allow it: its answer and the outcomes to
        count (that rule refused it; observe-mode rules that would have, counted and
        logged here); None lets the request go on."""
        if ((evaluation.config_refusal is None and not evaluation.config_would_refuse)
                or evaluation.refusal is not None or not req.known
                or not names_cluster_configs(req)):
            return None
        extra: list[Outcome] = []
        for would in evaluation.config_would_refuse:
            self._log_refusal(conn, req, would.rule, would.message, observe=True)
            extra.append(Outcome(would.rule, would.action, "refuse", "observe"))
        refusal = evaluation.config_refusal
        if refusal is None:
            self._emit(tuple(extra))
            return None
        self._log_refusal(conn, req, refusal.rule, refusal.message, observe=False)
        return (_refused(req, refusal.message, refusal.code, refusal.message),
                _refusing(evaluation, (refusal.rule,), refusal.action, extra))

    def _refused_produce(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation
                         ) -> tuple[Decision, tuple[Outcome, ...]] | None:
        """A Produce request that breaks a rule's ``produce_policy`` (its acks, its
        batches' compression or producer id: ``rules.produce``): POLICY_VIOLATION on
        every partition, saying what to change, and the outcomes to count; observe-mode
        policies it breaks are counted and logged.  None lets the request go on."""
        if ((not evaluation.produce_policies and not evaluation.produce_observed)
                or evaluation.refusal is not None or not req.known):
            return None
        body = req.body
        id_names = self._id_names(evaluation)
        extra: list[Outcome] = []
        for rule, policy in evaluation.produce_observed:
            broken = produce_violation(policy, body, id_names)
            if broken is not None and broken[0] != UNKNOWN_TOPIC_ID:
                self._log_refusal(conn, req, rule, f"{broken[1]} (rule {rule})", observe=True)
                extra.append(Outcome(rule, "produce_policy", "refuse", "observe"))
        for rule, policy in evaluation.produce_policies:
            broken = produce_violation(policy, body, id_names)
            if broken is None:
                continue
            code, reason = broken
            message = f"{reason} (rule {rule})"
            self._log_refusal(conn, req, rule, message, observe=False)
            return (_refused(req, message, code, message),
                    _refusing(evaluation, (rule,), "produce_policy", extra))
        self._emit(tuple(extra))
        return None

    def _checked_records(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation,
                         found: Mapping[tuple[str, bool], dict[PartitionKey, PartitionVerdict]]
                         ) -> _Withholding | tuple[Decision, tuple[Outcome, ...]] | None:
        """A Produce request's records held to the rules' ``validate_records``
        (``rules.records``): None when every partition passes (observe-mode rules that
        would refuse some counted and logged); else the partitions that pass, to send
        on, with the answer for the others (``_Withholding``), or, when none passes (or
        the request is acks=0, which has no answer to carry the errors), the request's
        answer, with the outcomes to count.  ``found``: the verdicts ``offload``'s work
        reached, by (rule, observe mode)."""
        if evaluation.refusal is not None or not req.known:
            return None
        extra: list[Outcome] = []
        for rule, validation in evaluation.records_observed:
            try:
                judged = (found[(rule, True)] if (rule, True) in found
                          else self._verdicts(validation, req, evaluation, observe=True))
            except Exception:  # observe mode must never break traffic
                logger.debug("observe-mode validate_records failed", exc_info=True)
                continue
            if judged:
                self._count_invalid(rule, "observe", judged, evaluation)
                (where, first), *_ = judged.items()
                self._log_refusal(conn, req, rule,
                                  f"{partition_place(*where)}: {first.message} (rule {rule})",
                                  observe=True, once=f"records {where[0]}")
                extra.append(Outcome(rule, "validate_records", "refuse", "observe"))
        withheld: dict[PartitionKey, PartitionVerdict] = {}
        refusing = None
        for rule, validation in evaluation.record_validations:
            judged = (found[(rule, False)] if (rule, False) in found
                      else self._verdicts(validation, req, evaluation))
            self._count_invalid(rule, "enforce", {
                where: partition for where, partition in judged.items()
                if where not in withheld}, evaluation)
            for where, partition in judged.items():
                if where not in withheld:
                    withheld[where] = PartitionVerdict(
                        partition.code, f"{partition.message} (rule {rule})",
                        partition.record_errors)
                    if refusing is None:
                        refusing = rule
                        self._log_refusal(conn, req, rule,
                                          f"{partition_place(*where)}: {withheld[where].message}",
                                          observe=False, once=f"records {where[0]}")
        if refusing is None:
            self._emit(tuple(extra))
            return None
        return _withholding_partitions(
            req, withheld, _refusing(evaluation, (refusing,), "validate_records", extra))

    def _sealed(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation,
                outcomes: tuple[Outcome, ...], found: SealedRequest | None
                ) -> Request | _Withholding | tuple[Decision, tuple[Outcome, ...]]:
        """A Produce request's values sealed (``encrypt_records``): the request to send
        on; or, where some partitions cannot be sealed, the others, with the answer for
        those (as ``_checked_records``).  ``found``: ``offload``'s work on it."""
        sealed = found or self._seal(req, evaluation, block=False)
        for (rule, topic), count in sealed.sealed.items():
            for listener in self.encryption_listeners:
                listener(rule, topic, "encrypted", count)
        for (rule, topic), count in sealed.kms_unavailable.items():
            for listener in self.encryption_listeners:
                listener(rule, topic, "kms_unavailable", count)
        if not sealed.refused:
            return sealed.request
        (where, first), *_ = sealed.refused.items()
        rules = tuple(dict.fromkeys(rule for rule, _ in evaluation.encryptions))
        self._log_refusal(conn, req, rules[0], f"{partition_place(*where)}: {first.message}",
                          observe=False, once=f"encrypt {where[0]}")
        return _withholding_partitions(
            sealed.request, sealed.refused,
            (*(o for o in outcomes if o.rule not in rules),
             *(Outcome(rule, "encrypt_records", "refuse", "enforce") for rule in rules)))

    def _seal(self, req: Request, evaluation: Evaluation, block: bool) -> SealedRequest:
        """``req`` sealed; ``block``: in a thread, where a KMS may be asked."""
        return seal_request(req, evaluation.encryptions, self._id_names(evaluation),
                            self.cipher, decompress, compress_zstd, self.kms.keys_of, block)

    def _open(self, resp: Response, evaluation: Evaluation, block: bool) -> OpenedAnswer:
        """The broker's Fetch (ShareFetch) answer with its sealed values opened; its
        topics named as the client knows them (the evaluation's map applied).
        ``block``: in a thread, where a KMS may be asked."""
        topic_map = evaluation.topic_map
        # Batches that came compressed go out compressed: zstd where the client's Fetch
        # version takes it (v10+, as brokers hold to), else gzip, which every one reads.
        repack = (("zstd", compress_zstd) if resp.api_key != FETCH or resp.api_version >= 10
                  else ("gzip", compress_gzip))
        return open_answer(resp, evaluation.encryptions, self._id_names(evaluation),
                           self.cipher, decompress,
                           None if topic_map is None else topic_map.to_client, repack,
                           self.kms.keys_of, block)

    def _count_opened(self, opened: OpenedAnswer) -> Response:
        for (rule, topic), count in opened.opened.items():
            for listener in self.encryption_listeners:
                listener(rule, topic, "decrypted", count)
        for (rule, topic), (count, reason) in opened.failed.items():
            for listener in self.encryption_listeners:
                listener(rule, topic, "undecryptable", count)
            self._log_encryption_trouble("records not decrypted: passed on encrypted",
                                         {"rule": rule, "topic": topic}, count, reason)
        for (rule, topic), (count, reason) in opened.withheld.items():
            for listener in self.encryption_listeners:
                listener(rule, topic, "kms_unavailable", count)
            self._log_encryption_trouble("records not decrypted: the KMS could not be "
                                         "asked; their partitions answered "
                                         "UNKNOWN_SERVER_ERROR (fetched again)",
                                         {"rule": rule, "topic": topic}, count, reason)
        return opened.response

    def _log_encryption_trouble(self, message: str, where: dict[str, str], count: int,
                                reason: str) -> None:
        """Records that did not decrypt, or were not sealed or opened for want of a
        KMS, logged: consumers fetch them again and again, so a line a minute per
        message and place (rule, topic or key), with how many since the last."""
        now = time.monotonic()
        key = (message, *where.values())
        logged, since = self._undecryptable_logged.get(key, (-math.inf, 0))
        if now - logged < _UNDECRYPTABLE_LOG_EVERY:
            self._undecryptable_logged[key] = (logged, since + count)
            return
        if len(self._undecryptable_logged) >= _UNDECRYPTABLE_LOGGED_MAX:
            self._undecryptable_logged.clear()
        self._undecryptable_logged[key] = (now, 0)
        log_event(logger, logging.WARNING, message, **where, records=count + since,
                  reason=reason)

    def _checked_topic_policy(self, conn: ConnectionInfo, req: Request,
                              evaluation: Evaluation
                              ) -> _Withholding | tuple[Decision, tuple[Outcome, ...]] | None:
        """The topics a CreateTopics, CreatePartitions or config request creates or
        changes, held to the rules' ``topic_policy`` (``rules.topicpolicy``): None when
        every one passes (observe-mode policies they break counted and logged); else the
        ones that pass, to send on, with the answer for the others (``_Withholding``),
        or, when none passes, the request's answer; with the outcomes to count."""
        if evaluation.refusal is not None or not req.known:
            return None
        if req.api_key == METADATA:
            return self._held_auto_creation(conn, req, evaluation)
        entries = entries_of(req)
        extra: list[Outcome] = []
        for rule, policy in evaluation.topic_policies_observed:
            try:
                problem = next((p for e in entries if (p := policy.entry_problem(
                    req.api_key, e)) is not None), None)
            except Exception:  # observe mode must never break traffic
                logger.debug("observe-mode topic_policy failed", exc_info=True)
                continue
            if problem is not None:
                self._log_refusal(conn, req, rule, f"{problem} (rule {rule})", observe=True)
                extra.append(Outcome(rule, "topic_policy", "refuse", "observe"))
        refused: dict[int, str] = {}
        refusing: list[str] = []  # the enforced rules that refused some, in order
        for i, entry in enumerate(entries):
            for rule, policy in evaluation.topic_policies:
                problem = policy.entry_problem(req.api_key, entry)
                if problem is not None:
                    refused[i] = f"{problem} (rule {rule})"
                    self._log_refusal(conn, req, rule, refused[i], observe=False)
                    if rule not in refusing:
                        refusing.append(rule)
                    break
        if not refused:
            self._emit(tuple(extra))
            return None
        outcomes = _refusing(evaluation, refusing, "topic_policy", extra)
        rest, answer = split_by_policy(req, refused)
        if rest is None:
            return Respond(answer), outcomes
        return _Withholding(rest, answer, outcomes, merge=merged_by_policy)

    def _held_auto_creation(self, conn: ConnectionInfo, req: Request,
                            evaluation: Evaluation) -> _Withholding | None:
        """A Metadata request that would have the brokers create a topic an enforced
        ``topic_policy`` refuses (its name, a required config: auto.create.topics.enable
        creates what Metadata asks for, with the brokers' defaults), sent on without
        ``allow_auto_topic_creation``: such a topic is not created, the others are
        described as they are.  Not counted as a refusal (the proxy cannot tell a topic
        that would be created from one that exists); v1-v3 create without asking, so
        cannot be held."""
        body = req.body
        if not asks_auto_creation(req) or not body.topics:
            return None
        for topic in body.topics:
            for rule, policy in evaluation.topic_policies:
                problem = topic.name and policy.auto_creation_problem(topic.name)
                if problem:
                    log_event(logger, logging.DEBUG, "topic creation on request turned off",
                              rule=rule, reason=problem, **conn.describe())
                    rest = req.replace(body=body.replace(allow_auto_topic_creation=False))
                    return _Withholding(rest, None, evaluation.outcomes)
        return None

    def _count_invalid(self, rule: str, mode: str,
                       judged: Mapping[PartitionKey, PartitionVerdict],
                       evaluation: Evaluation) -> None:
        """Tell the listeners how many records of each topic ``rule`` found invalid."""
        if not self.invalid_records_listeners:
            return
        by_topic: dict[str, int] = {}
        id_names = self._id_names(evaluation)
        for (topic, _), found in judged.items():
            if found.invalid:
                name = topic if isinstance(topic, str) else id_names(topic) or "unknown"
                by_topic[name] = by_topic.get(name, 0) + found.invalid
        for name, count in by_topic.items():
            for listener in self.invalid_records_listeners:
                listener(rule, name, mode, count)

    def offload(self, conn: ConnectionInfo, req: Request) -> Callable[[], None] | None:
        """A large Produce request's records read and judged (``validate_records``) in a
        thread: a batch of megabytes takes milliseconds (about 5 us a JSON record), which
        the other connections would otherwise wait out."""
        ruleset = self.ruleset
        if (req.api_key != PRODUCE or not ruleset or req.frame is None
                or len(req.frame) < _OFFLOAD_BYTES or not req.known):
            return None
        evaluation = _evaluated(ruleset, facts_of(conn, req), req, conn.state)
        if evaluation.refusal is not None:
            return None
        judged = conn.state.get("record_verdicts")
        judges = (bool(evaluation.record_validations or evaluation.records_observed)
                  and not (judged is not None and judged[0] is req))  # else: ``lookups``
        if not (judges or evaluation.encryptions):
            return None

        def work() -> None:
            if judges:
                conn.state["record_verdicts"] = (req, self._judged(req, evaluation,
                                                                   self.schemas.lookup))
            if evaluation.encryptions:
                # Used unless on_request takes some partitions out first (then it seals
                # what is left itself).
                conn.state[_SEALED] = (req, self._seal(req, evaluation, block=True))

        return work

    def offload_response(self, conn: ConnectionInfo, pending: Pending, resp: Response
                         ) -> Callable[[], None] | None:
        """A Fetch answer's values opened (``encrypt_records``): a large answer's in a
        thread; a small one's here, unless it holds a data key only a KMS opens (not
        opened before): then in a thread too, where the KMS is asked."""
        context = pending.context
        while isinstance(context, _Withheld):
            context = context.inner
        if not isinstance(context, _Opening) or resp.frame is None:
            return None
        evaluation = context.evaluation
        if len(resp.frame) < _OFFLOAD_BYTES:
            opened = self._open(resp, evaluation, block=False)
            if not opened.kms_needed:
                conn.state[_OPENED] = (resp, opened)
                return None

        def work() -> None:
            conn.state[_OPENED] = (resp, self._open(resp, evaluation, block=True))

        return work

    def _judged(self, req: Request, evaluation: Evaluation, lookup: SchemaLookup
                ) -> dict[tuple[str, bool], dict[PartitionKey, PartitionVerdict]]:
        """Every ``validate_records`` verdict on ``req``, by (rule, observe mode): what
        ``offload`` and ``lookups`` work out for ``on_request``."""
        found: dict[tuple[str, bool], dict[PartitionKey, PartitionVerdict]] = {}
        for rule, validation in evaluation.record_validations:
            found[(rule, False)] = self._verdicts(validation, req, evaluation, lookup=lookup)
        for rule, validation in evaluation.records_observed:
            try:
                found[(rule, True)] = self._verdicts(validation, req, evaluation, True, lookup)
            except Exception:  # observe mode must never break traffic
                logger.debug("observe-mode validate_records failed", exc_info=True)
        return found

    def lookups(self, conn: ConnectionInfo, req: Request
                ) -> Callable[[], Awaitable[None]] | None:
        """For a Produce request: the data keys a KMS must make before it is sealed
        (``encrypt_records.kms``; made ahead, before the last runs out, so that this
        seldom waits), then the schemas its records name (``_schema_lookups``)."""
        ruleset = self.ruleset
        if (not ruleset or req.api_key != PRODUCE or not req.known
                or not (ruleset.looks_up_schemas or ruleset.asks_kms)):
            return None
        evaluation = _evaluated(ruleset, facts_of(conn, req), req, conn.state)
        if evaluation.refusal is not None:
            return None
        judge = (self._schema_lookups(conn, req, evaluation) if ruleset.looks_up_schemas
                 else None)
        keks = self._keks_to_prepare(req, evaluation) if ruleset.asks_kms else []
        if not keks:
            return judge

        async def prepare_then_judge() -> None:
            for rule, kek, timeout in keks:
                await self._prepare(rule, kek, timeout)
            if judge is not None:
                await judge()

        return prepare_then_judge

    def _keks_to_prepare(self, req: Request, evaluation: Evaluation
                         ) -> list[tuple[str, Kek, float]]:
        """The KMS-held KEKs a Produce request's values would be sealed under that want
        a new DEK made, with a rule of each and how long the KMS may take."""
        encryptions = [(rule, e) for rule, e in evaluation.encryptions if e.kms is not None]
        if not encryptions:
            return []
        timeout = max(e.kms.timeout for _, e in encryptions if e.kms is not None)
        return [(rule, kek, timeout) for kek, rule in sealing_keks(
                    req, evaluation.encryptions, self._id_names(evaluation),
                    self.kms.keys_of).items()
                if kek.remote and not self.cipher.ready(kek)
                and not self.cipher.backing_off(kek)]

    async def _prepare(self, rule: str, kek: Kek, timeout: float) -> None:
        """A DEK of ``kek`` made by its KMS, in a thread; a KMS that fails or takes
        too long is logged (the request's partitions are then answered
        REQUEST_TIMED_OUT, and the producer sends them again)."""
        reason = f"no answer within {2 * timeout:g} s"
        with trio.move_on_after(2 * timeout) as waited:
            try:
                await trio.to_thread.run_sync(self.cipher.prepare, kek,
                                              abandon_on_cancel=True)
                return
            except KmsUnavailable as exc:  # the cipher keeps it (and backs off)
                reason = str(exc)
        if waited.cancelled_caught:
            self.cipher.failed(kek, reason)
        self._log_encryption_trouble("records not encrypted: the KMS made no data key; "
                                     "their partitions answered REQUEST_TIMED_OUT (sent "
                                     "again)", {"rule": rule, "key": kek.name}, 1, reason)

    def _schema_lookups(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation
                        ) -> Callable[[], Awaitable[None]] | None:
        """A Produce request judged (``validate_records``) with the schemas its records
        name, for the registry checks: judged once with the schemas kept; the ids not
        kept are fetched (``proxy.registry``), and then it is judged again, with them.
        The verdicts are ``on_request``'s (in a thread from 64 KiB on, as ``offload``)."""
        if not any(
                validation.looks_up_schemas for _, validation in (*evaluation.record_validations,
                                                            *evaluation.records_observed)):
            return None

        async def judge() -> None:
            large = req.frame is not None and len(req.frame) >= _OFFLOAD_BYTES
            now = trio.current_time()
            missing: set[tuple[RegistryCheck, int]] = set()

            def kept(check: RegistryCheck, schema_id: int) -> Lookup:
                found = self.schemas.known(check, schema_id, now)
                if found is None:
                    # Not kept: noted, and passed for now, so that the reading goes on
                    # and notes every id (these verdicts are then thrown away).
                    missing.add((check, schema_id))
                    return RegisteredSchema(schema_id, "")
                return found

            async def run(lookup: SchemaLookup
                          ) -> dict[tuple[str, bool], dict[PartitionKey, PartitionVerdict]]:
                if large:
                    return await trio.to_thread.run_sync(self._judged, req, evaluation,
                                                         lookup)
                return self._judged(req, evaluation, lookup)

            found = await run(kept)
            if missing:
                await self.schemas.fetch(missing)
                found = await run(self.schemas.lookup)
            conn.state["record_verdicts"] = (req, found)

        return judge

    def _in_scope(self, validation: RecordValidation, req: Request, evaluation: Evaluation,
                  observe: bool) -> Iterator[tuple[PartitionKey, Any, str | None]]:
        """Each partition of a Produce request ``validation`` holds to, with its key and
        its topic as the client names it; a partition of a topic named by an id not
        learned yet, when the validation names topics, with None (observe mode: left
        out)."""
        for topic, name in client_topic_names(req.body, self._id_names(evaluation)):
            key = topic_key(topic)
            if validation.topics is not None:
                if name is None:
                    if not observe:
                        yield from (((key, p.index), None, None) for p in topic.partition_data)
                    continue
                if not validation.applies_to(name):
                    continue
            for partition in topic.partition_data:
                yield (key, partition.index), partition, name

    def _verdicts(self, validation: RecordValidation, req: Request, evaluation: Evaluation,
                  observe: bool = False, lookup: SchemaLookup | None = None
                  ) -> dict[PartitionKey, PartitionVerdict]:
        """``validation``'s verdict on each partition of a Produce request it refuses.
        A topic named by an id not learned yet, when the validation names topics: its
        partitions get ``_UNSEEN_ID`` (observe mode: left out, not counted).  A partition
        whose schemas could not be looked up gets REQUEST_TIMED_OUT (observe mode: left
        out: nothing was found wrong)."""
        out: dict[PartitionKey, PartitionVerdict] = {}
        for where, partition, name in self._in_scope(validation, req, evaluation, observe):
            if partition is None:
                out[where] = _UNSEEN_ID
                continue
            found = verdict(validation, partition.records, decompress,
                            (DecompressionError,), lookup or self.schemas.lookup, name)
            if found is not None and not (observe and found.code == REQUEST_TIMED_OUT):
                out[where] = found
        return out

    def _id_names(self, evaluation: Evaluation) -> IdNames:
        """A topic id -> the name the client knows the topic by (None: not learned):
        the broker's name for it, mapped by the evaluation's topic map if there is one."""
        topic_map = evaluation.topic_map
        names = self.topic_ids.names

        def client_name(topic_id: bytes) -> str | None:
            name = names.get(topic_id)
            if name is None or topic_map is None:
                return name
            return topic_map.to_client(name)

        return client_name

    def _refused_ids(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation,
                     ruleset: RuleSet
                     ) -> list[_Withholding] | tuple[Decision, tuple[Outcome, ...]] | None:
        """Under a map that hides other tenants' topics (see ``rules.topicids``), a
        request that names by id a topic the client may not name, or one the proxy has
        not seen yet: sent on without those topics, the proxy answering them (a
        ``_Withholding`` for each kind of answer, in turn), or answered whole when
        nothing else is left; with the outcomes to count (the map's rule refused it, it
        renamed nothing).  None lets
        the request go on.  Such a topic is answered UNKNOWN_TOPIC_ID (another tenant's
        topic as no topic: it tells nothing), but one the client may see in Metadata
        (an ACL that lets it describe the topic, not read it): TOPIC_AUTHORIZATION_FAILED,
        as a broker's ACLs answer it."""
        topic_map = evaluation.topic_map
        if (evaluation.refusal is not None or topic_map is None
                or not topic_map.hides_others
                or not checks_ids(req.api.request, req.api_key, req.api_version)):
            return None
        foreign, unseen = self.topic_ids.refused(req, topic_map)
        if not (foreign or unseen):
            return None
        shown = partial(self.topic_ids.shown, mapping=topic_map)
        outcomes = tuple(Outcome(o.rule, "topic_id", "refuse", o.mode)
                         if o.action == "topics" and o.mode == "enforce" else o
                         for o in evaluation.outcomes)
        rule = next(o.rule for o in outcomes if o.action == "topic_id")
        message = _FOREIGN_ID if foreign else UNSEEN_ID
        steps: list[tuple[Callable[[bytes], bool | None], int, str]] = []
        seen = self._described(conn, req, ruleset, topic_map, foreign)
        others = foreign  # foreign ids the client does not see in Metadata either
        if seen is not None:
            # Denied here, seen in Metadata: as a broker's ACLs answer it.
            name, described = seen
            rule, action = _filter_rule(ruleset, evaluation.outcomes, "enforce", TOPIC, name,
                                        req.api_key)
            outcomes = tuple(Outcome(o.rule, action, "refuse", o.mode)
                             if o.rule == rule and o.action == "topic_id" else o
                             for o in outcomes)
            message = denied_message(name, rule)
            steps.append((lambda topic_id: not described(topic_id), TOPIC_AUTHORIZATION_FAILED,
                          message))
            others -= sum(map(described, request_ids(req)))
        steps.append((shown, UNKNOWN_TOPIC_ID, _FOREIGN_ID if others else UNSEEN_ID))
        self._log_refusal(conn, req, rule, message, observe=False)
        withheld: list[_Withholding] = []
        for test_shown, code, text in steps:

            def picks(request: Request, test_shown: Callable[[bytes], bool | None] = test_shown
                      ) -> bool:
                return any(test_shown(i) is not True for i in request_ids(request))

            if not picks(req):
                continue
            held = self._withheld_entries(req, unshown_ids(test_shown), code,
                                          partial(_same_text, text), outcomes, picks)
            if not isinstance(held, _Withholding):  # (or in no entry an answer mirrors)
                # Nothing else left: the whole request answered (by topic: a top-level
                # error would end a Fetch's session).
                return (_with_withheld(_refused(req, text, code, within="topic_id"), withheld),
                        outcomes)
            withheld.append(held)
            req = held.rest
        return withheld or None

    def _described(self, conn: ConnectionInfo, req: Request, ruleset: RuleSet,
                   topic_map: TopicMap, foreign: int
                   ) -> tuple[str, Callable[[bytes], bool]] | None:
        """For a request naming ``foreign`` topics by ids the client may not use here:
        when some of them it may see in Metadata (described), the first one's name (as
        the client knows it) and which ids are such; None when none is."""
        if not foreign:
            return None
        seen_map = ruleset.enforced_map(facts_of(conn, req), METADATA)
        names = self.topic_ids.names

        def client_name(topic_id: bytes) -> str | None:
            name = names.get(topic_id)
            if name is None or topic_map.to_client(name) is not None:
                return None  # not learned, or usable here
            return name if seen_map is None else seen_map.to_client(name)

        first = next((n for i in request_ids(req) if (n := client_name(i)) is not None), None)
        if first is None:
            return None
        return first, lambda topic_id: client_name(topic_id) is not None

    def _withheld_entries(self, req: Request, test: EntryTest, code: int,
                          message: Callable[[str | None], str | None],
                          outcomes: tuple[Outcome, ...],
                          still_refused: Callable[[Request], bool] | None = None,
                          names: tuple[str, ...] = NAME_ATTRS[TOPIC]
                          ) -> _Withholding | object | None:
        """``req``'s entries ``test`` picks, withheld (``rules.withhold``), as a broker
        answers each topic on its own: the rest to send on and the answer for them;
        ``_NOTHING`` when it picks none; None when the request is to be answered whole
        (nothing else is left, its API is answered whole, or what it is refused for is
        not in those entries)."""
        parts = split(req, test)
        if parts is None:
            return _NOTHING
        if parts is WHOLE:
            return None
        rest, mine, within = parts  # type: ignore[misc]
        if rest is None or (still_refused is not None and still_refused(rest)):
            return None
        if mine is None:  # forgotten topics only: nothing to answer
            return _Withholding(rest, None, outcomes)
        if req.api_key == PRODUCE and _acks(req) == 0:
            return _Withholding(rest, None, outcomes, close_after=(
                f"refused topics of an acks=0 Produce ({message(None)}): no response "
                "exists to carry the error, so the connection is closed"))
        return _Withholding(rest, answer_entries(mine, within, code, message, names),
                            outcomes, merge=merged_entries)

    def _would_refuse_ids(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation,
                          ruleset: RuleSet) -> tuple[Outcome, ...]:
        """An observe-mode map that would hide other tenants' topics: a request naming
        by id a topic it would keep from the client, counted and logged as the enforced
        map would refuse it.  Ids not seen yet are not counted: enforced, the client
        would have learned them through the proxy first."""
        observed = evaluation.observed_map
        if observed is None or not checks_ids(req.api.request, req.api_key,
                                              req.api_version):
            return ()
        try:
            foreign, _ = self.topic_ids.refused(req, observed)
        except Exception:  # observe mode must never break traffic
            return ()
        if not foreign:
            return ()
        rules = {r.name: r for r in ruleset.rules}
        rule = next((o.rule for o in evaluation.outcomes
                     if o.action == "topics" and o.mode == "observe" and o.rule in rules
                     and (m := rules[o.rule].map_for(req.api_key)) is not None
                     and m.hides_others),
                    "topic-map")
        self._log_refusal(conn, req, rule, _FOREIGN_ID, observe=True)
        return (Outcome(rule, "topic_id", "refuse", "observe"),)

    def _refused_topics(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation,
                        ruleset: RuleSet
                        ) -> list[_Withholding] | tuple[Decision, tuple[Outcome, ...]] | None:
        """Under a topic filter (``allow_topics`` / ``deny_topics``, ACL rules), a
        request that names a topic the client may not use: TOPIC_AUTHORIZATION_FAILED,
        as a broker answers a client its ACLs do not allow, for each such topic, the
        others sent on (a ``_Withholding`` for each kind of name, in turn: a Produce
        to two topics writes the allowed one, as a broker does), or the whole request
        answered (nothing else left, a name in no entry of its own, an API Kafka
        answers whole); with the outcomes to count (the filter's rule refused it); None
        lets the request go on.

        Not Metadata (but v0, which reads no topics as every topic): a client asks for
        the topics its application named, allowed or not, in one request; they go up
        without the ones it may not use (``map_request``), and the client reports those
        unknown."""
        topic_map = evaluation.topic_map
        if (evaluation.refusal is not None or topic_map is None or not topic_map.filters
                or not req.known or (req.api_key == METADATA and req.api_version > 0)):
            return None
        bad_cursor = cursor_refusal(req, topic_map)
        denied = _denied_names(req, topic_map) if bad_cursor is None else (TOPIC, "")
        if denied is None:
            return None
        kind, name = denied
        rule, action = _filter_rule(ruleset, evaluation.outcomes, "enforce", kind, name,
                                    req.api_key)
        within = None
        if bad_cursor is not None:
            # As a broker answers a cursor it cannot take (InvalidRequestException: for
            # a listing of every topic, an answer with no topics and no cursor).
            action, code, message = "listing_cursor", INVALID_REQUEST, f"{bad_cursor} (rule {rule})"
        else:
            code, message = _NOT_AUTHORIZED[kind], _denied_text(kind, name, rule)
            # A Fetch's topics get the error, not the Fetch: a top-level error ends its
            # session.
            within = "topic" if req.api_key == FETCH and kind == TOPIC else None
        outcomes = tuple(Outcome(o.rule, action, "refuse", o.mode)
                         if o.rule == rule and o.action == "topics" else o
                         for o in evaluation.outcomes)
        self._log_refusal(conn, req, rule, message, observe=False)
        if bad_cursor is not None:
            return (_refused(req, message, code, message, within), outcomes)
        # Each kind of name in turn: the entries naming ones the client may not use
        # taken out, each with its kind's error, as a broker's ACLs answer them.
        withheld: list[_Withholding] = []
        keys_kind = lookup_kind(req)
        for each in (TOPIC, *sorted(filtered_id_kinds(topic_map))):
            test = (denied_topics(topic_map) if each == TOPIC
                    else denied_ids(topic_map, each, keys_kind))
            text = partial(_entry_text, each, rule, message)
            held = self._withheld_entries(req, test, _NOT_AUTHORIZED[each], text, outcomes,
                                          names=NAME_ATTRS[each])
            if held is _NOTHING:
                continue
            if not isinstance(held, _Withholding):
                return (_with_withheld(_refused(req, message, _NOT_AUTHORIZED[each], message,
                                                within if each == TOPIC else None),
                                       withheld), outcomes)
            withheld.append(held)
            req = held.rest
        if not withheld or _denied_names(req, topic_map) is not None:
            # What it may not use is not in an entry (a group id of its own, a topic in
            # a subscription): refused whole.
            return (_with_withheld(_refused(req, message, code, message, within), withheld),
                    outcomes)
        return withheld

    def _would_refuse_topics(self, conn: ConnectionInfo, req: Request, evaluation: Evaluation,
                             ruleset: RuleSet) -> tuple[Outcome, ...]:
        """An observe-mode topic filter: what it would refuse (counted and logged; not
        Metadata but v0, as enforced)."""
        observed = evaluation.observed_map
        if (observed is None or not req.known
                or (req.api_key == METADATA and req.api_version > 0)):
            return ()
        try:
            denied = _denied_names(req, observed)
        except Exception:  # observe mode must never break traffic
            return ()
        if denied is None:
            return ()
        kind, name = denied
        rule, action = _filter_rule(ruleset, evaluation.outcomes, "observe", kind, name,
                                    req.api_key)
        self._log_refusal(conn, req, rule, _denied_text(kind, name, rule), observe=True)
        return (Outcome(rule, action, "refuse", "observe"),)

    def _log_refusal(self, conn: ConnectionInfo, req: Request, rule: str, message: str,
                     observe: bool, once: str | None = None) -> None:
        """Logged once per connection, API, rule and reason (``once``: what stands for
        the reason, where messages differ request by request)."""
        for listener in self.refusal_listeners:
            listener(conn, req, rule, "would_refuse" if observe else "refuse")
        logged = conn.state.setdefault("refusals_logged", set())
        key = (req.api_key, rule, observe, message if once is None else once)
        if key in logged:
            return  # once per connection, API, rule and reason
        logged.add(key)
        log_event(logger, logging.INFO, "would refuse (observe mode)" if observe else "refused",
                  rule=rule, api=api_name(req.api_key),
                  version=req.api_version, reason=message, **conn.describe())


# Read by the proxy itself or carrying no names: a version newer than the tables goes
# on (ApiVersions' answer is how a client learns which versions to use).
_NEVER_READ = frozenset(API_KEYS_BY_NAME[name] for name in (
    "ApiVersions", "SaslHandshake", "SaslAuthenticate"))


def _denied_names(req: Request, topic_map: TopicMap) -> tuple[str, str] | None:
    """The first name ``req`` names (a topic by name, a group or transactional id) that
    ``topic_map`` does not let it use, as (``TOPIC`` or the id's kind, name)."""
    names: Sequence[Any] | None = None
    if req.api_key == PRODUCE and not req.body_decoded:
        counted = produce.request_topics_of(req)  # from its bytes, as the metrics read it
        if counted is not None:
            names = [topic for topic, *_ in counted if isinstance(topic, str) and topic]
    if names is None:
        names = topic_names(req)
    for name in names:
        if topic_map.denies(name):
            return TOPIC, name
    kinds = topic_map.id_kinds
    if _may_name_ids(req, kinds):
        for kind, name in id_names(req, kinds):
            if topic_map.denies_id(kind, name):
                return kind, name
    return None


def _filters_names_in(req: Request, topic_map: TopicMap) -> bool:
    """Whether a filter in ``topic_map`` restricts names of a kind ``req`` may hold: a
    group filter does not, say, in a Produce request (a transactional id filter does)."""
    if any(isinstance(m, TopicFilter) for m in map_parts(topic_map)):
        return True
    return _may_name_ids(req, filtered_id_kinds(topic_map))


def _may_name_ids(req: Request, kinds: frozenset[str]) -> bool:
    """Whether ``req`` can hold ids of ``kinds``: FindCoordinator's keys, fields, or
    resources (ACLs', configs': their types say)."""
    return bool(kinds) and (req.api_key == FIND_COORDINATOR
                            or names_ids(req.api.request, req.api_version, kinds)
                            or names_resources(req.api.request, req.api_version))


def _observes_ids(ruleset: RuleSet | None) -> bool:
    """Whether an observe-mode rule of ``ruleset`` would hide other tenants' topics (it
    then counts requests naming their ids: the ids are learned from the answers)."""
    return ruleset is not None and any(
        r.mode == "observe" and any(m.hides_others for m in r.maps()) for r in ruleset.rules)


def _denied_text(kind: str, name: str, rule: str) -> str:
    return denied_message(name, rule) if kind == TOPIC else denied_id_message(kind, name, rule)


def _filter_rule(ruleset: RuleSet, outcomes: tuple[Outcome, ...], mode: str, kind: str,
                 name: str, api_key: int) -> tuple[str, str]:
    """(rule, action) for a refused name: the first rule of ``mode`` whose topic map
    was applied and refuses it on its own (``rules.topics.denial``, ``id_denial``);
    else the first applied rule with a filter (a name only the composed maps refuse)."""
    rules = {r.name: r for r in ruleset.rules}
    applied = [rules[o.rule] for o in outcomes
               if o.action == "topics" and o.mode == mode and o.rule in rules]
    for rule in applied:
        topic_map = rule.map_for(api_key)
        if topic_map is None:
            continue
        action = (denial(topic_map, name) if kind == TOPIC
                  else id_denial(topic_map, kind, name))
        if action is not None:
            return rule.name, action
    fallback = next((r.name for r in applied if (m := r.map_for(api_key)) is not None
                     and m.filters), "topic-filter")
    return fallback, "deny_topics" if kind == TOPIC else f"deny_{ID_FILTER_KEYS[kind]}"


def _refusing(evaluation: Evaluation, rules: Sequence[str], action: str,
              observed: Sequence[Outcome]) -> tuple[Outcome, ...]:
    """The outcomes of a request enforced ``rules`` refused (some of) on its body: each
    one's refusal in place of what the header-only evaluation said of it, the others'
    as they were, and the ``observed`` observe-mode refusals."""
    return (*(o for o in evaluation.outcomes if o.rule not in rules), *observed,
            *(Outcome(rule, action, "refuse", "enforce") for rule in rules))


def _refused(req: Request, reason: str, code: int, message: str | None = None,
             within: str | None = None) -> Decision:
    """The error response to a refused request (``error_response``); a refused acks=0
    Produce request has none, and closes the connection instead."""
    if req.api_key == PRODUCE and _acks(req) == 0:
        return Close(f"refused acks=0 Produce ({reason}): no response exists to carry the "
                     "error, so the connection is closed")
    return Respond(error_response(req, code, message, within))


@dataclass(frozen=True, slots=True)
class _Withholding:
    """A Produce request's partitions that pass ``validate_records`` (a CreateTopics'
    topics that pass ``topic_policy``...: ``rest``), the proxy's ``answer`` for the
    others, how the broker's answer and it are put together, and the outcomes to count;
    for an acks=0 Produce request, no answer but the reason to close the connection once
    ``rest`` is sent."""

    rest: Request
    answer: Response | None
    outcomes: tuple[Outcome, ...]
    close_after: str | None = None
    merge: Callable[[Response, Response], Response] = merged


@dataclass(frozen=True, slots=True)
class _Opening:
    """The context of a Fetch (ShareFetch) request whose answer's values are opened
    for the client (``encrypt_records``), with the evaluation that says how, and the
    context the rest of the policy gave it (``inner``)."""

    inner: Any
    evaluation: Evaluation


def _withholding_partitions(req: Request, withheld: dict[PartitionKey, PartitionVerdict],
                            outcomes: tuple[Outcome, ...]
                            ) -> _Withholding | tuple[Decision, tuple[Outcome, ...]]:
    """A Produce request sent on without its ``withheld`` partitions, which the proxy
    answers; none left: the proxy's answer alone.  acks=0, as a broker does: the
    partitions that pass are written, then the connection closes, the only way to tell
    the client of the others."""
    rest = without(req, withheld)
    if _acks(req) == 0:
        place = partition_place(*next(iter(withheld)))
        reason = (f"refused records of an acks=0 Produce ({place}): no response exists "
                  "to carry the error, so the connection is closed")
        if rest is None:
            return Close(reason), outcomes
        return _Withholding(rest, None, outcomes, close_after=reason)
    answer = withheld_answer(req, withheld)
    if rest is None:
        return Respond(answer), outcomes
    return _Withholding(rest, answer, outcomes)


@dataclass(frozen=True, slots=True)
class _Withheld:
    """The context of a request sent on without some partitions (topics): the context
    the rest of the policy gave it (``inner``), the answer for those, and how to put
    the two answers together."""

    inner: Any
    answer: Response
    merge: Callable[[Response, Response], Response]


def _with_withheld(decision: Decision, withheld: Sequence[_Withholding]) -> Decision:
    """``decision`` on what was left of a request once ``withheld`` took some of its
    entries out: the proxy's answers for those merged into the answer to the rest, the
    broker's (a context ``on_response`` reads) or its own; for an acks=0 Produce, the
    connection closed once the rest is sent."""
    if not withheld or isinstance(decision, Close):
        return decision
    answers = [w for w in withheld if w.answer is not None]
    if isinstance(decision, Respond):
        resp = decision.response
        for w in answers:
            resp = w.merge(resp, w.answer)  # type: ignore[arg-type]
        return Respond(resp)
    close_after = next((w.close_after for w in withheld if w.close_after), None)
    if not answers:
        return (decision if close_after is None
                else dataclasses.replace(decision, close_after=close_after))
    context = decision.context if decision.wants_response else None
    for w in answers:
        context = _Withheld(context, w.answer, w.merge)  # type: ignore[arg-type]
    return dataclasses.replace(decision, wants_response=True, context=context,
                               close_after=close_after)


# ``_withheld_entries``' word for a request none of whose entries a test picks.
_NOTHING = object()


def _entry_text(kind: str, rule: str, whole: str, name: str | None) -> str:
    """The error text of an entry naming ``name`` of ``kind`` a filter of ``rule``
    does not allow (``whole``: the request's, for an entry that names none itself)."""
    return _denied_text(kind, name, rule) if name else whole


def _same_text(text: str, _name: str | None) -> str:
    return text


def _acks(req: Request) -> int:
    from gatehouse.codecs.peek import produce_acks

    return produce_acks(req)


class RulesSource:
    """Where the rules come from, for loading and hot reload (inline or a rules file)."""

    def __init__(self, config_path: Path | None, rules_file: Path | None,
                 inline: Any = None) -> None:
        self.config_path = config_path
        self.rules_file = rules_file
        self.inline = inline

    @property
    def watched(self) -> Path | None:
        return self.rules_file or self.config_path

    def load(self) -> RuleSet:
        if self.rules_file is not None:
            from gatehouse.rules import load_rules_file

            return load_rules_file(self.rules_file)
        if self.config_path is not None:
            data = load_yaml_file(self.config_path)
            rules = data.get("rules") if isinstance(data, dict) else None
            return parse_rules(rules, str(self.config_path))
        return parse_rules(self.inline)


class Reloader:
    """Validates and swaps rules; a bad file keeps the old rules in force."""

    def __init__(self, policy: RulesPolicy, source: RulesSource,
                 shared_identity: bool = False) -> None:
        self.policy = policy
        self.source = source
        # The brokers see the proxy's one user for every client (sasl.upstream).
        self.shared_identity = shared_identity
        self.succeeded = 0
        self.failed = 0
        self.last_error: str | None = None
        self.listeners: list[Callable[[bool], None]] = []
        self._watch = self._watching(policy.ruleset)

    def _watching(self, ruleset: RuleSet) -> FileWatch:
        """The rules' own file and the files they read (JSON Schemas)."""
        watched = self.source.watched
        return FileWatch((*(() if watched is None else (watched,)), *ruleset.files))

    def changed(self) -> bool:
        return self._watch.changed()

    def reload(self) -> bool:
        try:
            ruleset = self.source.load()
        except (ConfigError, RecursionError) as exc:
            # PyYAML recurses once per nesting level: "[[[[..." must not end the proxy.
            error = (str(exc) if isinstance(exc, ConfigError)
                     else f"{self.source.watched}: nested too deeply to parse")
            self.failed += 1
            self.last_error = error
            log_event(logger, logging.ERROR, "rules reload failed: keeping the old rules",
                      error=error)
            for listener in self.listeners:
                listener(False)
            return False
        self.policy.ruleset = ruleset  # atomic swap: new requests see the new rules
        if ruleset.files != self._watch.paths[1 if self.source.watched else 0:]:
            self._watch = self._watching(ruleset)
        self.succeeded += 1
        self.last_error = None
        log_event(logger, logging.INFO, "rules reloaded", rules=len(ruleset.rules),
                  source=ruleset.source)
        for advice in ruleset.advice(shared_identity=self.shared_identity):
            log_event(logger, logging.WARNING, "rules advice", advice=advice)
        for listener in self.listeners:
            listener(True)
        return True
