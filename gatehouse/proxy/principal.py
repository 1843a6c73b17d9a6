"""Who a TLS client is: the subject of the certificate the proxy's client CA verified,
written as Kafka writes an SSL client's principal, and Kafka's principal mapping rules
(``ssl.principal.mapping.rules``) to turn it into a short name (pure).

The proxy ends the client's TLS, so the brokers see the proxy, never the client's
certificate: at the edge the proxy is the only place that can tell such clients apart.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

# The attribute keywords of RFC 4514 (and RFC 2253 before it), by the names Python's ssl
# module gives them (OpenSSL's long names).  Others keep those names.
_KEYWORDS: Final = {
    "commonName": "CN",
    "localityName": "L",
    "stateOrProvinceName": "ST",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "streetAddress": "STREET",
    "domainComponent": "DC",
    "userId": "UID",
}
_ESCAPED: Final = frozenset(',+"\\<>;')


def certificate_principal(cert: Mapping[str, Any] | None) -> str | None:
    """The subject of a verified client certificate (``SSLObject.getpeercert()``) as a
    distinguished name, the way Kafka's default principal builder writes an SSL client's
    (``X500Principal.getName()``, RFC 2253): most specific part first
    (``CN=app,OU=team-a,O=corp``), values escaped, several attributes of one part joined
    by ``+``.  None without a certificate or with an empty subject."""
    subject = (cert or {}).get("subject") or ()
    parts = ["+".join(f"{_KEYWORDS.get(name, name)}={_escape(value)}" for name, value in rdn)
             for rdn in reversed(subject)]
    return ",".join(parts) or None


def _escape(value: str) -> str:
    out = "".join(f"\\{c}" if c in _ESCAPED else "\\00" if c == "\0" else c for c in value)
    if len(value) > 1 and value.endswith(" "):
        out = out[:-1] + "\\ "
    return "\\" + out if value.startswith(("#", " ")) else out


class PrincipalMappingError(ValueError):
    """A principal mapping rule that cannot be read (the config names where)."""


# One rule of Kafka's ``ssl.principal.mapping.rules``, then the separator before the next:
# DEFAULT, or RULE:pattern/replacement/ with an optional L or U (lower or upper case the
# result); "/" and "\" inside a pattern or replacement are escaped with "\".
_RULE = re.compile(r"\s*(?:(DEFAULT)|RULE:((?:\\.|[^\\/])*)/((?:\\.|[^\\/])*)/([LU]?))"
                   r"\s*(?:[,\n]|$)")
_JAVA_GROUP = re.compile(r"\\(.)|\$(\d+|\{\w+\})")
_JAVA_NAMED = re.compile(r"\(\?<([A-Za-z]\w*)>")


@dataclass(frozen=True)
class MappingRule:
    pattern: re.Pattern[str] | None  # None: DEFAULT (the whole name)
    replacement: str = ""  # as Python's Match.expand takes it
    case: str = ""  # "L", "U" or ""

    def apply(self, name: str) -> str | None:
        if self.pattern is None:
            return name
        found = self.pattern.fullmatch(name)
        if found is None:
            return None
        mapped = found.expand(self.replacement)
        return mapped.lower() if self.case == "L" else mapped.upper() if self.case == "U" else mapped


def parse_principal_mapping(text: str) -> tuple[MappingRule, ...]:
    """Kafka's ``ssl.principal.mapping.rules`` (its syntax, so that brokers' rules can be
    copied as they are): rules in order, separated by commas or new lines; the first
    whose pattern matches the whole name gives the principal.  The pattern is a regular
    expression (Java's and Python's agree on what rules use: groups, named groups,
    classes, lazy quantifiers, anchors) and the replacement names groups as Java does
    (``$1``, ``${name}``)."""
    rules: list[MappingRule] = []
    pos, end = 0, len(text.rstrip())
    while pos < end:
        found = _RULE.match(text, pos)
        if found is None or found.end() == pos:
            raise PrincipalMappingError(f"not a principal mapping rule (RULE:pattern/"
                                        f"replacement/[LU] or DEFAULT): {text[pos:].strip()!r}")
        default, pattern, replacement, case = found.groups()
        pos = found.end()
        if default:
            rules.append(MappingRule(None))
            continue
        # Java names a group (?<name>...); Python (?P<name>...).
        pattern = _JAVA_NAMED.sub(r"(?P<\1>", pattern.replace("\\/", "/"))
        try:
            compiled = re.compile(pattern)
        except re.error as exc:
            raise PrincipalMappingError(f"pattern {pattern!r}: {exc}") from None
        rules.append(MappingRule(compiled, _python_replacement(replacement), case))
    if not rules:
        raise PrincipalMappingError("no principal mapping rules")
    return tuple(rules)


def _python_replacement(java: str) -> str:
    """A Java replacement (``$1``, ``${name}``, ``\\$`` for a dollar) as ``Match.expand``
    takes it (``\\g<1>``)."""
    def convert(found: re.Match[str]) -> str:
        escaped, group = found.groups()
        if escaped is not None:
            return escaped.replace("\\", "\\\\")
        return f"\\g<{group.strip('{}')}>"

    return _JAVA_GROUP.sub(convert, java)


def mapped_principal(rules: tuple[MappingRule, ...], name: str) -> str | None:
    """The principal the first matching rule gives; None when no rule matches (Kafka then
    refuses the client, and so does the proxy)."""
    for rule in rules:
        mapped = rule.apply(name)
        if mapped is not None:
            return mapped
    return None
