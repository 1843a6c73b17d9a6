"""Reading rules from YAML, with every mistake reported as file:line."""

from __future__ import annotations

import re
import urllib.parse
from pathlib import Path
from types import MappingProxyType
from typing import Any

from gatehouse.codecs import API_KEYS_BY_NAME, APIS
from gatehouse.configfile import (
    ConfigError,
    LocatedList,
    Reader,
    Source,
    line_of,
    load_yaml_file,
)
from gatehouse.rules.acl import (
    CLUSTER_OPS,
    KIND_KEYS,
    OPERATIONS,
    AclEntry,
    cluster_config_refusals,
    cluster_refusals,
    compile_acls,
)
from gatehouse.rules.encryption import (
    KEY_BYTES,
    TOPIC_PLACEHOLDER,
    KmsSpec,
    RecordEncryption,
    load_key_ring,
)
from gatehouse.rules.model import (
    API_VERSIONS,
    PRODUCE,
    QUOTA_SCOPES,
    Match,
    Quota,
    Rule,
    RuleSet,
    VersionBound,
    parse_version,
)
from gatehouse.rules.produce import ACKS_NAMES, COMPRESSION_NAMES, ProducePolicy
from gatehouse.rules.protobuf import ProtoFile, ProtoSchemaError, load_proto_file
from gatehouse.rules.records import (
    DEFAULT_MAX_DECOMPRESSED,
    FORMATS,
    FieldCheck,
    RecordValidation,
    RegistryCheck,
    load_json_schema,
    shown_url,
)
from gatehouse.rules.topicpolicy import Bound, ConfigCheck, TopicPolicy
from gatehouse.rules.topics import (
    ID_FILTER_KEYS,
    Chain,
    IdFilter,
    NameFilter,
    Prefix,
    Rename,
    TopicFilter,
    TopicMap,
)

_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_SOFTWARE_RE = re.compile(r"^[a-zA-Z0-9](?:[a-zA-Z0-9\-.]*[a-zA-Z0-9])?$")  # KIP-511


def _api_key(name: Any, source: Source, line: int | None) -> int:
    if isinstance(name, int) and not isinstance(name, bool) and name in APIS:
        return name
    if isinstance(name, str):
        key = API_KEYS_BY_NAME.get(name)
        if key is None:  # be kind to case slips, strict on typos
            lowered = {n.lower(): k for n, k in API_KEYS_BY_NAME.items()}
            key = lowered.get(name.lower())
        if key is not None:
            return key
    close = [n for n in API_KEYS_BY_NAME if isinstance(name, str)
             and n.lower().startswith(str(name)[:3].lower())][:3]
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    raise source.error(f"unknown API name {name!r}{hint}", line)


def _bounds(reader: Reader, key: str, minimum: bool) -> dict[int, VersionBound]:
    raw = reader.take(key, dict)
    out: dict[int, VersionBound] = {}
    if raw is None:
        return out
    for name, value in raw.items():
        line = line_of(raw, name)
        api = _api_key(name, reader.source, line)
        if minimum and api == API_VERSIONS:
            raise reader.source.error(
                "ApiVersions cannot have a minimum version: clients must always be able to "
                "ask which versions exist (KIP-35)", line)
        # Produce: raising the advertised minimum above 0 makes librdkafka turn
        # compression off (KAFKA-18727, librdkafka #4956), so by default refuse old
        # Produce versions without advertising the raise.
        advertise = not (minimum and api == PRODUCE)
        if isinstance(value, dict):
            sub = Reader(value, reader.source, f"{key}.{name}", line)
            version = sub.require("version", int)
            advertise = sub.take("advertise", bool, advertise)
            sub.finish()
        elif isinstance(value, int) and not isinstance(value, bool):
            version = value
        else:
            raise reader.source.error(
                f"{key}.{name} must be a version number or {{version: N, advertise: bool}}",
                line)
        valid = APIS[api].versions
        if not 0 <= version <= 0x7FFF:
            raise reader.source.error(f"{key}.{name}: version {version} is out of range", line)
        if minimum and version > valid.hi:
            raise reader.source.error(
                f"{key}.{name}: v{version} is above every version of {APIS[api].name} "
                f"known (v{valid.lo}-v{valid.hi}): every request would be refused", line)
        out[api] = VersionBound(version, advertise)
    return out


def _api_set(reader: Reader, key: str) -> frozenset[int] | None:
    raw = reader.take(key, list)
    if raw is None:
        return None
    return frozenset(_api_key(item, reader.source, line_of(raw, i)) for i, item in enumerate(raw))


def _regex(reader: Reader, key: str) -> re.Pattern[str] | None:
    text = reader.take(key, str)
    if text is None:
        return None
    try:
        return re.compile(text)
    except re.error as exc:
        raise reader.error(key, f"match.{key}: bad regular expression: {exc}") from None


def _match(reader: Reader) -> Match:
    sources = reader.take_networks("source", "match.source") or ()
    listeners_raw = reader.take("listener", (str, list))
    listeners: tuple[str, ...] = ()
    if listeners_raw is not None:
        listeners = tuple(str(x) for x in (
            [listeners_raw] if isinstance(listeners_raw, str) else listeners_raw))
    match = Match(
        client_id=_regex(reader, "client_id"),
        software_name=_regex(reader, "client_software_name"),
        software_version=_regex(reader, "client_software_version"),
        sources=sources,
        listeners=listeners,
        principal=_regex(reader, "principal"),
    )
    reader.finish()
    return match


def _name_patterns(reader: Reader, key: str) -> tuple[re.Pattern[str], ...] | None:
    """``allow_topics`` / ``deny_topics`` (``_groups``, ``_transactional_ids``): regular
    expressions over whole names."""
    items = reader.take_each(key, str)
    if items is None:
        return None
    patterns = []
    for item, line in items:
        if not isinstance(item, str):
            raise reader.source.error(f"{key}: {item!r} is not a regular expression", line)
        try:
            patterns.append(re.compile(item))
        except re.error as exc:
            raise reader.source.error(f"{key}: {item!r} is not a regular expression: {exc}",
                                      line) from None
    return tuple(patterns)


def _topic(value: Any, source: Source, line: int | None, what: str) -> str:
    if not isinstance(value, str) or not _TOPIC_RE.match(value):
        raise source.error(f"{what}: {value!r} is not a valid Kafka topic name", line)
    return value


def _rule(data: Any, source: Source, line: int | None, index: int) -> Rule:
    reader = Reader(data, source, f"rules[{index}]", line)
    name = reader.require("name", str)
    mode = reader.take("mode", str, "enforce")
    if mode not in ("enforce", "observe"):
        raise reader.error("mode", f"mode must be enforce or observe, not {mode!r}")
    match = _match(reader.child("match"))
    minimum = _bounds(reader, "min_api_version", True)
    maximum = _bounds(reader, "max_api_version", False)
    for api, bound in minimum.items():
        if api in maximum and maximum[api].version < bound.version:
            raise reader.error("max_api_version",
                               f"{APIS[api].name}: maximum v{maximum[api].version} is below "
                               f"the minimum v{bound.version}")
    deny = _api_set(reader, "deny_apis") or frozenset()
    allow = _api_set(reader, "allow_apis")
    if API_VERSIONS in deny:
        raise reader.error("deny_apis", "ApiVersions cannot be denied: no client could connect")
    software_raw = reader.take("min_client_software", dict) or {}
    software: dict[str, tuple[int, ...]] = {}
    software_text: dict[str, str] = {}
    for sw_name, version in software_raw.items():
        sw_line = line_of(software_raw, sw_name)
        if not _SOFTWARE_RE.match(sw_name):
            raise source.error(f"min_client_software: {sw_name!r} is not a KIP-511 software "
                               "name", sw_line)
        parsed = parse_version(str(version))
        if parsed is None:
            raise source.error(f"min_client_software.{sw_name}: {version!r} is not a version",
                               sw_line)
        software[sw_name.lower()] = parsed
        software_text[sw_name.lower()] = str(version)
    unknown = reader.take("unknown_software", str, "allow")
    if unknown not in ("allow", "refuse"):
        raise reader.error("unknown_software", "unknown_software must be allow or refuse")
    topic_map: TopicMap | None = None
    renames_raw = reader.take("rename_topics", dict)
    prefix_raw = reader.take("topic_prefix", (dict, str))
    if renames_raw is not None and prefix_raw is not None:
        raise reader.error("topic_prefix", "one rule cannot both rename and prefix topics: "
                           "use two rules (they compose in order)")
    if renames_raw is not None:
        renames: dict[str, str] = {}
        targets: dict[str, str] = {}
        for client, broker in renames_raw.items():
            r_line = line_of(renames_raw, client)
            _topic(client, source, r_line, "rename_topics")
            _topic(broker, source, r_line, f"rename_topics.{client}")
            if broker in targets:
                raise source.error(f"rename_topics: {client!r} and {targets[broker]!r} both "
                                   f"rename to {broker!r}", r_line)
            targets[broker] = client
            renames[client] = broker
        _check_cycles(renames, source, reader.line_of("rename_topics"))
        topic_map = Rename(renames)
    elif prefix_raw is not None:
        if isinstance(prefix_raw, str):
            prefix, hide, groups, transactions = prefix_raw, False, False, False
        else:
            sub = Reader(prefix_raw, source, "topic_prefix", reader.line_of("topic_prefix"))
            prefix = sub.require("broker", str)
            hide = sub.take("hide_others", bool, False)
            groups = sub.take("groups", bool, False)
            transactions = sub.take("transactional_ids", bool, False)
            sub.finish()
        if not prefix or not _TOPIC_RE.match(prefix):
            raise reader.error("topic_prefix", f"topic_prefix: {prefix!r} cannot start a topic "
                               "name")
        topic_map = Prefix(prefix, hide, groups, transactions)
    filters: list[TopicMap] = []  # the client's names: before this rule's rename or prefix
    allow_topics = _name_patterns(reader, "allow_topics")
    deny_topics = _name_patterns(reader, "deny_topics")
    if allow_topics is not None or deny_topics:
        filters.append(TopicFilter(allow_topics, deny_topics or ()))
    by_kind: dict[str, NameFilter] = {}
    for kind, key in ID_FILTER_KEYS.items():
        allow_ids = _name_patterns(reader, f"allow_{key}")
        deny_ids = _name_patterns(reader, f"deny_{key}")
        if allow_ids is not None or deny_ids:
            by_kind[kind] = NameFilter(allow_ids, deny_ids or ())
    if by_kind:
        filters.append(IdFilter(by_kind))
    if filters:
        parts = (*filters, topic_map) if topic_map is not None else tuple(filters)
        topic_map = parts[0] if len(parts) == 1 else Chain(parts)
    acls_raw = reader.take("acls", list)
    api_maps = None
    cluster_refused: dict[int, tuple[str, int]] = {}
    cluster_configs: dict[int, str] = {}
    names_cluster = False
    if acls_raw is not None:
        if filters:
            raise reader.error("acls", "one rule cannot have both acls and allow_/deny_ "
                               "lists: say it in the acls (or use two rules)")
        entries = _acl_entries(acls_raw, source, reader.line_of("acls"))
        api_maps = compile_acls(entries, topic_map)
        cluster_refused = cluster_refusals(entries)
        cluster_configs = cluster_config_refusals(entries)
        names_cluster = any(e.cluster for e in entries)
    quota_raw = reader.take("quota", dict)
    quota = (None if quota_raw is None
             else _quota(Reader(quota_raw, source, "quota", reader.line_of("quota"))))
    policy_raw = reader.take("produce_policy", dict)
    produce_policy = (None if policy_raw is None else _produce_policy(
        Reader(policy_raw, source, "produce_policy", reader.line_of("produce_policy"))))
    validation_raw = reader.take("validate_records", dict)
    validation = (None if validation_raw is None else _validate_records(
        Reader(validation_raw, source, "validate_records", reader.line_of("validate_records"))))
    topic_policy_raw = reader.take("topic_policy", dict)
    topic_policy = (None if topic_policy_raw is None else _topic_policy(
        Reader(topic_policy_raw, source, "topic_policy", reader.line_of("topic_policy"))))
    encryption_raw = reader.take("encrypt_records", dict)
    encryption = None
    if encryption_raw is not None:
        if mode == "observe":
            raise reader.error("encrypt_records", "encrypt_records cannot be observed (mode: "
                               "observe): records are encrypted or they are not")
        encryption = _encrypt_records(Reader(encryption_raw, source, "encrypt_records",
                                             reader.line_of("encrypt_records")))
    reader.finish()
    return Rule(name=name, match=match, mode=mode,
                min_api_version=minimum, max_api_version=maximum, deny_apis=deny,
                allow_apis=allow, min_client_software=software,
                min_client_software_text=software_text,
                unknown_software=unknown,
                topic_map=topic_map, quota=quota, line=line, api_maps=api_maps,
                cluster_refused=MappingProxyType(cluster_refused),
                cluster_configs=MappingProxyType(cluster_configs),
                acls_name_cluster=names_cluster, produce_policy=produce_policy,
                validate_records=validation, topic_policy=topic_policy,
                encrypt_records=encryption)


def _encrypt_records(reader: Reader) -> RecordEncryption:
    """``encrypt_records: {topics, key_file, key, kms, max_decompressed_bytes}``: the
    topics whose values the rule's clients have encrypted as they produce and decrypted
    as they fetch, under the key ``key`` of ``key_file`` (any of its keys decrypts), or
    under ``kms``' key (the key file, if given too, opens what older keys sealed)."""
    topics = _topic_scope(reader, "encrypt_records")
    kms = _kms(reader)
    key_file = reader.require("key_file", str) if kms is None else reader.take("key_file",
                                                                               str)
    ring = None
    if key_file is not None:
        try:
            ring = load_key_ring(_beside_rules(key_file, reader.source.file))
        except ConfigError as exc:
            raise reader.error("key_file", f"encrypt_records.key_file: {exc}") from None
    if kms is not None:
        if reader.take("key", str) is not None:
            raise reader.error("key", "encrypt_records.key names a key of the key file; "
                               "with kms, the key is kms.key")
        key = kms.kek_name
    else:
        assert ring is not None
        key = reader.require("key", str)
        if key not in ring.keys:
            raise reader.error("key", f"encrypt_records.key: {key!r} is not a key of "
                               f"{ring.path} (it has {', '.join(sorted(ring.keys))}); a key "
                               f"is {KEY_BYTES} random bytes in base64")
    limit = _max_decompressed(reader, "encrypt_records")
    reader.finish()
    return RecordEncryption(topics, key, ring, limit, kms)


_KMS_TYPES = {"aws": "AWS KMS (or a service that speaks its API)",
              "vault": "a HashiCorp Vault or OpenBao transit secrets engine"}
# The keys only one type of KMS takes.
_KMS_ONLY = {"aws": ("region",),
             "vault": ("address", "mount", "token_file", "namespace", "ca_file")}
# A Vault transit key's name (its path segment; ``{topic}`` stands for a topic's name).
_VAULT_KEY = re.compile(r"[\w.@{}-]+")


def _kms(reader: Reader) -> KmsSpec | None:
    """``kms: {type, key, timeout_seconds, ...}``: the KMS that holds the key-encryption
    key.  aws: ``region``, ``endpoint``; vault: ``address``, ``mount``, ``token_file``,
    ``namespace``, ``ca_file``.  Credentials are never here: the AWS SDK's own chain finds
    them; Vault's token is in a file (Vault Agent's sink) or VAULT_TOKEN."""
    raw = reader.take("kms", dict)
    if raw is None:
        return None
    sub = Reader(raw, reader.source, "encrypt_records.kms", reader.line_of("kms"))
    kind = sub.require("type", str)
    if kind not in _KMS_TYPES:
        raise sub.error("type", f"encrypt_records.kms.type: {kind!r} is not one of "
                        + ", ".join(f"{k} ({v})" for k, v in _KMS_TYPES.items()))
    for other, keys in _KMS_ONLY.items():
        for name in keys:
            if other != kind and name in raw:
                raise sub.error(name, f"encrypt_records.kms.{name} is for type {other}, "
                                f"not {kind}")
    if "credentials" in raw or "access_key_id" in raw or "secret_access_key" in raw or (
            "token" in raw):
        raise sub.error(None, "encrypt_records.kms takes no credentials: "
                        + ("the AWS SDK finds them (environment, profile, web identity on "
                           "Kubernetes, instance role)" if kind == "aws" else
                           "Vault's token is read from token_file (Vault Agent's sink) or "
                           "VAULT_TOKEN"))
    key = sub.require("key", str)
    if not key or len(f"{kind}-kms:{key}".encode()) > 255:
        what = ("a key id, key ARN, alias name (alias/...) or alias ARN" if kind == "aws"
                else "a transit key's name")
        raise sub.error("key", f"encrypt_records.kms.key: {what}, at most "
                        f"{255 - len(f'{kind}-kms:')} bytes")
    braces = key.replace(TOPIC_PLACEHOLDER, "")
    if kind == "aws" and ("{" in braces or "}" in braces or (
            TOPIC_PLACEHOLDER in key and not key.startswith(("alias/", "arn:")))):
        raise sub.error("key", f"encrypt_records.kms.key: {key!r}: the one placeholder is "
                        f"{TOPIC_PLACEHOLDER} (each topic's key: an alias, alias/...-"
                        f"{TOPIC_PLACEHOLDER}, or an alias ARN)")
    if kind == "vault" and ("{" in braces or "}" in braces or not _VAULT_KEY.fullmatch(key)):
        raise sub.error("key", f"encrypt_records.kms.key: {key!r}: a transit key's name "
                        f"(letters, digits, _ - . @; {TOPIC_PLACEHOLDER} for each topic's "
                        "key)")
    timeout = sub.take("timeout_seconds", (int, float), 5.0)
    if not 0 < timeout <= 60:
        raise sub.error("timeout_seconds", "encrypt_records.kms.timeout_seconds: more than "
                        "0 and at most 60 (a Produce request waits for it)")
    if kind == "aws":
        spec = KmsSpec(kind, key, sub.take("region", str), _url(sub, "endpoint"),
                       float(timeout))
    else:
        address = _url(sub, "address")
        if address is None:
            raise sub.error(None, "encrypt_records.kms.address: Vault's address "
                            "(https://vault.example:8200) is required with type vault")
        mount = sub.take("mount", str, "transit").strip("/")
        if not mount or not re.fullmatch(r"[\w.@/-]+", mount):
            raise sub.error("mount", f"encrypt_records.kms.mount: {mount!r} is not a mount "
                            "path (transit, team-a/transit)")
        files = {part: None if (name := sub.take(part, str)) is None
                 else str(_beside_rules(name, reader.source.file))
                 for part in ("token_file", "ca_file")}  # beside the rules unless absolute
        spec = KmsSpec(kind, key, None, address, float(timeout), mount, files["token_file"],
                       sub.take("namespace", str), files["ca_file"])
    sub.finish()
    return spec


def _url(reader: Reader, key: str) -> str | None:
    url: str | None = reader.take(key, str)
    if url is not None and urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise reader.error(key, f"encrypt_records.kms.{key}: {url!r} is not an http(s) URL")
    return url


def _max_decompressed(reader: Reader, what: str) -> int:
    """``max_decompressed_bytes`` of a part of a rule that reads records: the most a
    batch may decompress to."""
    limit = reader.take("max_decompressed_bytes", int, DEFAULT_MAX_DECOMPRESSED)
    if limit < 1:
        raise reader.error("max_decompressed_bytes", f"{what}.max_decompressed_bytes "
                           "must be a positive number of bytes")
    return int(limit)


def _validate_records(reader: Reader) -> RecordValidation:
    """``validate_records: {topics, key, value, headers, max_decompressed_bytes}``: what
    the records the rule's clients produce must hold (at least one of key, value,
    headers)."""
    topics = _topic_scope(reader, "validate_records")
    key = _field_check(reader, "key")
    value = _field_check(reader, "value")
    headers: list[str] = []
    for header, line in reader.take_each("headers", str) or ():
        if not isinstance(header, str) or not header:
            raise reader.source.error(f"validate_records.headers: {header!r} is not a header "
                                      "key", line)
        headers.append(header)
    limit = _max_decompressed(reader, "validate_records")
    if key == FieldCheck() and value == FieldCheck() and not headers:
        raise reader.error(None, "validate_records needs at least one of key, value, headers "
                           "to check")
    reader.finish()
    return RecordValidation(topics, key, value, tuple(headers), limit)


def _field_check(reader: Reader, what: str) -> FieldCheck:
    """``key`` / ``value``: a format name, or ``{required, format, max_bytes}``."""
    raw = reader.take(what, (str, dict))
    if raw is None:
        return FieldCheck()
    where = f"validate_records.{what}"
    if isinstance(raw, str):
        if raw not in FORMATS:
            raise reader.error(what, f"{where}: {raw!r} is not one of {', '.join(FORMATS)}")
        return FieldCheck(format=raw)  # type: ignore[arg-type]
    sub = Reader(raw, reader.source, where, reader.line_of(what))
    required = sub.take("required", bool, False)
    fmt = sub.take("format", str)
    if fmt is not None and fmt not in FORMATS:
        raise sub.error("format", f"{where}.format: {fmt!r} is not one of {', '.join(FORMATS)}")
    max_bytes = sub.take("max_bytes", int)
    if max_bytes is not None and max_bytes < 0:
        raise sub.error("max_bytes", f"{where}.max_bytes must be a number of bytes")
    schema = None
    schema_file = sub.take("schema", str)
    if schema_file is not None:
        if fmt not in (None, "json"):
            raise sub.error("schema", f"{where}.schema is a JSON Schema: its format is json, "
                            f"not {fmt}")
        fmt = "json"
        try:
            schema = load_json_schema(_beside_rules(schema_file, reader.source.file))
        except ValueError as exc:
            raise sub.error("schema", f"{where}.schema: {exc}") from None
    protobuf = None
    if sub.has("protobuf"):
        if fmt is not None:
            raise sub.error("protobuf", f"{where}.protobuf is a message of a .proto file: "
                            f"it takes no format ({fmt})")
        fmt = "protobuf"
        protobuf = _protobuf_file(sub, reader.source.file, f"{where}.protobuf")
    registry = None
    if sub.has("registry"):
        if fmt not in (None, "schema_registry"):
            raise sub.error("registry", f"{where}.registry looks up Schema Registry ids: its "
                            f"format is schema_registry, not {fmt}")
        fmt = "schema_registry"
        registry = _registry_check(sub, f"{where}.registry")
    sub.finish()
    check = FieldCheck(required, fmt, max_bytes, schema, registry, protobuf)
    if check == FieldCheck():
        raise reader.error(what, f"{where} needs at least one of required: true, format, "
                           "max_bytes, schema, registry, protobuf")
    return check


def _beside_rules(name: str, rules_file: str) -> Path:
    """A file a rule names: beside the rules' file unless absolute (or the rules are
    not from a file)."""
    path = Path(name)
    if not path.is_absolute() and not rules_file.startswith("<"):
        path = Path(rules_file).parent / path
    return path


def _protobuf_file(reader: Reader, rules_file: str, where: str) -> ProtoFile:
    """``protobuf: FILE`` or ``{file, message}``: the ``.proto`` file (beside the rules'
    file unless absolute) whose message (its full name; the file's first if left out)
    a key or value must be."""
    raw = reader.take("protobuf", (str, dict))
    sub = (Reader({}, reader.source, where, reader.line_of("protobuf")) if isinstance(raw, str)
           else Reader(raw, reader.source, where, reader.line_of("protobuf")))
    name = raw if isinstance(raw, str) else sub.require("file", str)
    message = sub.take("message", str)
    sub.finish()
    try:
        return load_proto_file(_beside_rules(name, rules_file), message)
    except ProtoSchemaError as exc:
        raise reader.error("protobuf", f"{where}: {exc}") from None


def _registry_check(reader: Reader, where: str) -> RegistryCheck:
    """``registry: URL`` or ``{url, validate, timeout, subject}``: the Schema Registry whose ids
    a ``schema_registry`` key or value must name."""
    raw = reader.take("registry", (str, dict))
    sub = (Reader({}, reader.source, where, reader.line_of("registry")) if isinstance(raw, str)
           else Reader(raw, reader.source, where, reader.line_of("registry")))
    url = raw if isinstance(raw, str) else sub.require("url", str)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise reader.error("registry", f"{where}: {shown_url(url)!r} is not an http:// "
                           "or https:// URL (the registry's REST API, e.g. "
                           "http://registry:8081)")
    validate = sub.take("validate", bool, True)
    timeout = sub.take("timeout", (int, float), 5.0)
    if not 0 < timeout <= 60:
        raise sub.error("timeout", f"{where}.timeout must be 0-60 seconds")
    subject = sub.take("subject", str)
    if subject is not None and (not subject or "{" in subject.replace("{topic}", "")):
        raise sub.error("subject", f"{where}.subject: {subject!r} is not a subject name "
                        "({topic} standing for the topic, as in '{topic}-value')")
    sub.finish()
    return RegistryCheck(url.rstrip("/"), validate, float(timeout), subject)



def _produce_policy(reader: Reader) -> ProducePolicy:
    """``produce_policy: {acks, compression, idempotent}``: what the rule's clients'
    Produce requests must be (at least one of the three)."""
    acks: frozenset[int] | None = None
    values = reader.take_each("acks", (str, int))
    if values is not None:
        parsed = set()
        for value, line in values:
            code = ACKS_NAMES.get(str(value).lower())
            if code is None or isinstance(value, bool):
                raise reader.source.error(f"produce_policy.acks: {value!r} is not all, 1 or 0",
                                          line)
            parsed.add(code)
        if not parsed:
            raise reader.error("acks", "produce_policy.acks must name at least one value")
        acks = frozenset(parsed)
    compression: frozenset[str] | None = None
    names = reader.take_each("compression", str)
    if names is not None:
        for name, line in names:
            if str(name).lower() not in COMPRESSION_NAMES:
                raise reader.source.error(f"produce_policy.compression: {name!r} is not one "
                                          f"of {', '.join(COMPRESSION_NAMES)}", line)
        if not names:
            raise reader.error("compression", "produce_policy.compression must name at least "
                               "one codec")
        compression = frozenset(str(name).lower() for name, _ in names)
    idempotent = reader.take("idempotent", bool, False)
    if acks is None and compression is None and not idempotent:
        raise reader.error(None, "produce_policy needs at least one of acks, compression, "
                           "idempotent: true")
    topics = _topic_scope(reader, "produce_policy")
    reader.finish()
    return ProducePolicy(acks, compression, idempotent, topics)


def _topic_policy(reader: Reader) -> TopicPolicy:
    """``topic_policy: {names, partitions, replication_factor, configs}``: what topics the
    rule's clients create or change must be (at least one of the four)."""
    names = _name_patterns(reader, "names")
    if names is not None and not names:
        raise reader.error("names", "topic_policy.names must name at least one pattern "
                           "(leave it out for any name)")
    bounds = {key: _count_bound(reader, key) for key in ("partitions", "replication_factor")}
    configs: dict[str, ConfigCheck] = {}
    raw = reader.take("configs", dict)
    if raw is not None:
        for name, value in raw.items():
            line = line_of(raw, name)
            if not isinstance(value, dict):
                raise reader.source.error(f"topic_policy.configs.{name}: expected a mapping "
                                          "of min, max, allow, required", line)
            configs[str(name)] = _config_check(
                str(name), Reader(value, reader.source, f"topic_policy.configs.{name}", line))
    reader.finish()
    if names is None and not any(bounds.values()) and not configs:
        raise reader.error(None, "topic_policy needs at least one of names, partitions, "
                           "replication_factor, configs")
    return TopicPolicy(names, bounds["partitions"], bounds["replication_factor"],
                       MappingProxyType(configs))


def _count_bound(reader: Reader, key: str) -> Bound | None:
    """``{min, max}``: whole numbers of at least 1, min not above max."""
    raw = reader.take(key, dict)
    if raw is None:
        return None
    sub = Reader(raw, reader.source, f"topic_policy.{key}", reader.line_of(key))
    low, high = sub.take("min", int), sub.take("max", int)
    sub.finish()
    for end, value in (("min", low), ("max", high)):
        if value is not None and value < 1:
            raise sub.error(end, f"topic_policy.{key}.{end} must be a whole number of at "
                            f"least 1, not {value!r}")
    if low is None and high is None:
        raise sub.error(None, f"topic_policy.{key} needs min, max or both")
    if low is not None and high is not None and low > high:
        raise sub.error("max", f"topic_policy.{key}: max {high} is below min {low}")
    return Bound(low, high)


def _config_check(name: str, reader: Reader) -> ConfigCheck:
    """One topic config's ``{min, max, allow, required}``."""
    what = reader.what
    low, high = reader.take("min", (int, float)), reader.take("max", (int, float))
    if low is not None and high is not None and low > high:
        raise reader.error("max", f"{what}: max {high} is below min {low}")
    allowed = reader.take_each("allow", (str, int, float))
    if allowed is not None and not allowed:
        raise reader.error("allow", f"{what}.allow must name at least one value")
    if allowed is not None and (low is not None or high is not None):
        raise reader.error("allow", f"{what}: allow a list of values, or bound a number "
                           "with min/max, not both")
    required = reader.take("required", bool, False)
    reader.finish()
    if low is None and high is None and allowed is None and not required:
        raise reader.error(None, f"{what} needs min, max, allow or required: true")
    return ConfigCheck(name, None if low is None else float(low),
                       None if high is None else float(high),
                       None if allowed is None else frozenset(str(v) for v, _ in allowed),
                       required)


def _topic_scope(reader: Reader, what: str) -> tuple[re.Pattern[str], ...] | None:
    """``topics`` of a part of a rule that holds some topics only (None: all)."""
    topics = _name_patterns(reader, "topics")
    if topics is not None and not topics:
        raise reader.error("topics", f"{what}.topics must name at least one topic (leave "
                           "it out for every topic)")
    return topics


def _acl_entries(raw: list[Any], source: Source, line: int | None) -> list[AclEntry]:
    """``acls``: entries of ``allow`` or ``deny`` (operations) and ``topics``,
    ``groups``, ``transactional_ids`` (regular expressions over whole names) or
    ``cluster: true``; each operation one that every resource the entry names has."""
    if not raw:
        raise source.error("acls needs at least one entry", line)
    entries = []
    for i, item in enumerate(raw):
        what = f"acls[{i}]"
        entry = Reader(item, source, what, line_of(raw, i) or line)
        given = [key for key in ("allow", "deny") if entry.has(key)]
        if len(given) != 1:
            raise entry.error(given[1] if given else None,
                              f"{what} needs exactly one of allow or deny (operations: "
                              f"{', '.join(OPERATIONS)}; on the cluster: "
                              f"{', '.join(CLUSTER_OPS)})")
        ops_raw = entry.take(given[0], (list, str))
        ops = [ops_raw] if isinstance(ops_raw, str) else ops_raw
        if not ops:
            raise entry.error(given[0], f"{what}.{given[0]} needs at least one operation")
        names = {kind: patterns for kind, key in KIND_KEYS.items()
                 if (patterns := _name_patterns(entry, key)) is not None}
        cluster = entry.take("cluster", bool, False)
        for op in ops:
            if names and op not in OPERATIONS:
                raise entry.error(given[0], f"{what}.{given[0]}: {op!r} is not an operation "
                                  f"on names ({', '.join(OPERATIONS)})")
            if cluster and op not in CLUSTER_OPS:
                raise entry.error(given[0], f"{what}.{given[0]}: {op!r} is not an operation "
                                  f"on the cluster ({', '.join(CLUSTER_OPS)})")
            if not names and not cluster and op not in OPERATIONS + CLUSTER_OPS:
                raise entry.error(given[0], f"{what}.{given[0]}: {op!r} is not an operation "
                                  f"({', '.join(OPERATIONS)}; on the cluster: "
                                  f"{', '.join(CLUSTER_OPS)})")
        entry.finish()
        if not names and not cluster:
            raise entry.error(None, f"{what} needs topics, groups or transactional_ids "
                              "(regular expressions over whole names), or cluster: true")
        entries.append(AclEntry(given[0] == "allow", frozenset(ops), names, cluster))
    return entries


def _quota(reader: Reader) -> Quota:
    """``quota: {produce_bytes_per_second, fetch_bytes_per_second, requests_per_second,
    per}``: at least one rate, each a positive number."""
    rates: dict[str, float | None] = {}
    for kind in ("produce_bytes", "fetch_bytes", "requests"):
        key = f"{kind}_per_second"
        value = reader.take(key, (int, float))
        if value is not None and not value > 0:
            raise reader.error(key, f"quota.{key} must be positive, not {value}")
        rates[kind] = None if value is None else float(value)
    per = reader.take("per", str, "principal")
    if per not in QUOTA_SCOPES:
        raise reader.error("per", f"quota.per must be one of {', '.join(QUOTA_SCOPES)}, "
                           f"not {per!r}")
    reader.finish()  # a misspelt rate is named as such, before "needs a rate"
    if all(rate is None for rate in rates.values()):
        raise reader.error(None, "quota needs produce_bytes_per_second, "
                           "fetch_bytes_per_second or requests_per_second")
    return Quota(per=per, **rates)


def _check_cycles(renames: dict[str, str], source: Source, line: int | None) -> None:
    for start in renames:
        seen = [start]
        name = renames[start]
        while name in renames:
            if name in seen:
                raise source.error("rename_topics has a cycle: " + " -> ".join([*seen, name]),
                                   line)
            seen.append(name)
            name = renames[name]


def parse_rules(data: Any, source_name: str = "<rules>") -> RuleSet:
    source = Source(source_name)
    if data is None:
        return RuleSet((), source_name)
    if isinstance(data, dict):  # a rules file may be {rules: [...]} or just the list
        reader = Reader(data, source, "rules file")
        data = reader.require("rules", list)
        reader.finish()
    if not isinstance(data, list):
        raise source.error("rules must be a list of rules", line_of(data))
    rules = []
    names: dict[str, int | None] = {}
    for i, item in enumerate(data):
        line = line_of(data, i) if isinstance(data, LocatedList) else None
        rule = _rule(item, source, line, i)
        if rule.name in names:
            raise source.error(f"two rules are named {rule.name!r} (the other is at line "
                               f"{names[rule.name]})", line)
        names[rule.name] = line
        rules.append(rule)
    # Renames across rules: two client names must not land on one broker name.
    landing: dict[str, str] = {}
    for rule in rules:
        if isinstance(rule.topic_map, Rename) and rule.mode == "enforce":
            for client, broker in rule.topic_map.client_to_broker.items():
                other = landing.get(broker)
                if other is not None and other != client:
                    raise source.error(f"rule {rule.name!r} renames {client!r} to {broker!r}, "
                                       f"which another rule already gives to {other!r}",
                                       rule.line)
                landing[broker] = client
    return RuleSet(tuple(rules), source_name)


def load_rules_file(path: str | Path) -> RuleSet:
    return parse_rules(load_yaml_file(path), str(path))


__all__ = ["ConfigError", "load_rules_file", "parse_rules"]
