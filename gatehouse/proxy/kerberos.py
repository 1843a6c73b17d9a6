"""SASL GSSAPI (Kerberos) at both ends of the proxy: its own logins to the brokers
(``sasl.upstream``, ``capture.kafka.sasl``: the proxy's principal, its keys from a
keytab, tickets in a memory credential cache of its own), and clients' logins to it
(``sasl.downstream.kerberos``: its service keys from a keytab, the principals proved
named as Kafka's principal-to-local rules name them), and clients' logins passing
through to the brokers (``sasl.passthrough_kerberos``: the brokers' keys read the
client's ticket, for its name only).

GSS-API is MIT Kerberos's ``libgssapi_krb5`` (on every Debian and Red Hat system, and
in the container image), called through ctypes: no Python package to build.  Its calls
block (they ask the KDC for tickets), so the async caller runs each step in a thread.

``KerberosLogin`` is the client side of RFC 4752 as Kafka's brokers (Java's GSSAPI
SaslServer) speak it: the GSS-API context's tokens until it is established (mutual
authentication), then the broker's wrapped offer of security layers, answered with
"none" (Kafka's SASL takes no layer; TLS protects the bytes when they need it).
``KerberosAcceptance`` is the server side, as a broker answers Kafka's clients."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from gatehouse.codecs.scram import SaslError

GSSAPI: Final = "GSSAPI"
DEFAULT_SERVICE_NAME: Final = "kafka"  # Kafka's sasl.kerberos.service.name default

_OM = ctypes.c_uint32
_GSS_S_CONTINUE_NEEDED = 1
_GSS_C_GSS_CODE, _GSS_C_MECH_CODE = 1, 2
_GSS_C_INITIATE, _GSS_C_ACCEPT = 1, 2
_GSS_C_INDEFINITE = 0xFFFFFFFF
# What Kafka's Java client asks for: mutual authentication, messages in order,
# integrity and confidentiality available to the security-layer exchange.
_FLAGS = 0x2 | 0x8 | 0x20 | 0x10  # MUTUAL | SEQUENCE | INTEG | CONF
# RFC 4752: the security layer "none" (bit 0) and no maximum message size: the client's
# choice, and the proxy's offer as a server.
_NO_SECURITY_LAYER = b"\x01\x00\x00\x00"
# OIDs (DER bodies): Kerberos 5 principal names, host-based service names, the mechanism.
_KRB5_NT_PRINCIPAL_NAME = b"\x2a\x86\x48\x86\xf7\x12\x01\x02\x02\x01"
_NT_HOSTBASED_SERVICE = b"\x2a\x86\x48\x86\xf7\x12\x01\x02\x01\x04"
_KRB5_MECHANISM = b"\x2a\x86\x48\x86\xf7\x12\x01\x02\x02"


class _Buffer(ctypes.Structure):
    _fields_ = [("length", ctypes.c_size_t), ("value", ctypes.c_void_p)]


class _Oid(ctypes.Structure):
    _fields_ = [("length", _OM), ("elements", ctypes.c_void_p)]


class _KeyValue(ctypes.Structure):
    _fields_ = [("key", ctypes.c_char_p), ("value", ctypes.c_char_p)]


class _KeyValueSet(ctypes.Structure):
    _fields_ = [("count", _OM), ("elements", ctypes.POINTER(_KeyValue))]


_library: Any = None
_library_lock = threading.Lock()


def _load(short: str, soname: str, missing: str) -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library(short) or soname)
    except OSError:
        raise SaslError(missing) from None


def gssapi_library() -> Any:
    """MIT's libgssapi_krb5, loaded once; SaslError saying what to install if absent."""
    global _library
    with _library_lock:
        if _library is None:
            missing = ("GSSAPI needs MIT Kerberos's GSS-API library, libgssapi_krb5.so.2 "
                       "(Debian: libgssapi-krb5-2; Red Hat: krb5-libs)")
            lib = _load("gssapi_krb5", "libgssapi_krb5.so.2", missing)
            if not hasattr(lib, "gss_acquire_cred_from"):  # MIT's, 1.11 and later
                raise SaslError(missing)
            for name in ("gss_import_name", "gss_acquire_cred_from", "gss_init_sec_context",
                         "gss_accept_sec_context", "gss_display_name", "gss_wrap",
                         "gss_unwrap", "gss_release_buffer", "gss_release_name",
                         "gss_release_cred", "gss_delete_sec_context", "gss_display_status"):
                getattr(lib, name).restype = _OM
            _library = lib
        return _library


def _oid(body: bytes) -> tuple[_Oid, Any]:
    """An OID struct over ``body`` and the buffer it points into (kept alive with it)."""
    data = ctypes.create_string_buffer(body, len(body))
    return _Oid(len(body), ctypes.cast(data, ctypes.c_void_p)), data


def _in(data: bytes) -> tuple[_Buffer, Any]:
    keep = ctypes.create_string_buffer(data, len(data))
    return _Buffer(len(data), ctypes.cast(keep, ctypes.c_void_p)), keep


def _taken(lib: Any, buffer: _Buffer) -> bytes:
    """The bytes of a buffer GSS-API filled, released."""
    data = ctypes.string_at(buffer.value, buffer.length) if buffer.length else b""
    minor = _OM()
    lib.gss_release_buffer(ctypes.byref(minor), ctypes.byref(buffer))
    return data


def _status(lib: Any, major: int, minor: int) -> str:
    """GSS-API's own words for a failure: the general status, then the mechanism's
    (Kerberos's: "Client not found in Kerberos database", "Cannot find KDC", ...)."""
    words = []
    for code, kind in ((major, _GSS_C_GSS_CODE), (minor, _GSS_C_MECH_CODE)):
        if not code:
            continue
        context = _OM(0)
        for _ in range(8):
            out, ignored = _Buffer(), _OM()
            lib.gss_display_status(ctypes.byref(ignored), _OM(code), kind, None,
                                   ctypes.byref(context), ctypes.byref(out))
            text = _taken(lib, out).decode("utf-8", "replace").strip()
            if text and text not in words:
                words.append(text)
            if not context.value:
                break
    if len(words) > 1 and words[0].startswith("Unspecified GSS failure"):
        del words[0]  # "...Minor code may provide more information": it follows
    return ": ".join(words) or f"GSS-API status {major:#x}/{minor:#x}"


def _check(lib: Any, major: int, minor: _OM, what: str) -> None:
    if major & 0xFFFF0000:  # a calling or routine error (the low bits are informational)
        raise SaslError(f"{what}: {_status(lib, major, minor.value)}")


def keytab_principals(data: bytes) -> list[str]:
    """The principals a keytab file holds keys for, in order, each once (MIT's format,
    version 2, as kadmin, ktutil and Active Directory's ktpass write it); ValueError if
    the bytes are not one."""
    if data[:2] != b"\x05\x02":
        raise ValueError("not a keytab (version 2 keytabs start with 0x05 0x02)")
    found: dict[str, None] = {}
    at = 2
    while at + 4 <= len(data):
        size = int.from_bytes(data[at:at + 4], "big", signed=True)
        at += 4
        if size < 0:  # a hole left by a removed entry
            at += -size
            continue
        if size == 0:
            break
        entry, at = data[at:at + size], at + size
        if len(entry) < size:
            raise ValueError("a keytab entry runs past the end of the file")
        pos, parts = 2, []
        for _ in range(int.from_bytes(entry[0:2], "big") + 1):  # the realm, then the names
            length = int.from_bytes(entry[pos:pos + 2], "big")
            parts.append(entry[pos + 2:pos + 2 + length].decode("utf-8", "replace"))
            pos += 2 + length
            if pos > len(entry):
                raise ValueError("a keytab entry's principal runs past the entry")
        realm, *names = parts
        found["/".join(names) + "@" + realm] = None
    return list(found)


def _import_name(lib: Any, text: str, kind: bytes, what: str) -> ctypes.c_void_p:
    """A GSS-API name (release it with gss_release_name) of ``kind`` (an OID body)."""
    minor, name = _OM(), ctypes.c_void_p()
    given, keep_given = _in(text.encode())
    oid, keep_oid = _oid(kind)
    _check(lib, lib.gss_import_name(ctypes.byref(minor), ctypes.byref(given),
                                    ctypes.byref(oid), ctypes.byref(name)), minor, what)
    del keep_given, keep_oid
    return name


def _acquire(lib: Any, name: ctypes.c_void_p | None, usage: int,
             store: dict[bytes, bytes], what: str) -> ctypes.c_void_p:
    """A credential from MIT's credential store (``store``: keytab, client_keytab,
    ccache...) for ``name`` (None: any the store holds)."""
    minor, handle = _OM(), ctypes.c_void_p()
    items = (_KeyValue * len(store))(*(_KeyValue(k, v) for k, v in store.items()))
    major = lib.gss_acquire_cred_from(
        ctypes.byref(minor), name, _OM(_GSS_C_INDEFINITE), None, usage,
        ctypes.byref(_KeyValueSet(len(store), items)), ctypes.byref(handle), None, None)
    _check(lib, major, minor, what)
    return handle


@dataclass(frozen=True)
class KerberosCredentials:
    """The proxy's Kerberos identity: ``principal`` (``gatehouse/proxy.example.com@REALM``),
    its keys in ``keytab``, the brokers' service name (their principals are
    ``{service_name}/{broker host}@REALM``).  ``username`` and ``mechanism`` as the other
    credentials have them, for logs."""

    principal: str
    keytab: Path
    service_name: str = DEFAULT_SERVICE_NAME
    mechanism: str = GSSAPI

    @property
    def username(self) -> str:
        return self.principal


class KerberosIdentity:
    """A principal's GSS-API credential: acquired once from its keytab into a memory
    cache of its own, which keeps its tickets (one from the KDC per service, not per
    connection) and renews them from the keytab as they expire.  Thread-safe."""

    _caches = itertools.count()

    def __init__(self, credentials: KerberosCredentials) -> None:
        self.credentials = credentials
        self._lock = threading.Lock()
        self._handle: ctypes.c_void_p | None = None
        self._cache = f"MEMORY:gatehouse-{os.getpid()}-{next(self._caches)}"

    @property
    def mechanism(self) -> str:
        return GSSAPI

    @property
    def username(self) -> str:
        return self.credentials.principal

    def handle(self) -> ctypes.c_void_p:
        with self._lock:
            if self._handle is None:
                self._handle = self._acquire()
            return self._handle

    def _acquire(self) -> ctypes.c_void_p:
        lib, creds = gssapi_library(), self.credentials
        name = _import_name(lib, creds.principal, _KRB5_NT_PRINCIPAL_NAME,
                            f"the principal {creds.principal!r}")
        try:
            return _acquire(lib, name, _GSS_C_INITIATE,
                            {b"client_keytab": os.fsencode(creds.keytab),
                             b"ccache": self._cache.encode()},
                            f"no credential for {creds.principal!r} from keytab "
                            f"{str(creds.keytab)!r}")
        finally:
            lib.gss_release_name(ctypes.byref(_OM()), ctypes.byref(name))

    def close(self) -> None:
        with self._lock:
            if self._handle is not None:
                gssapi_library().gss_release_cred(ctypes.byref(_OM()),
                                                  ctypes.byref(self._handle))
                self._handle = None


@functools.cache
def kerberos_identity(credentials: KerberosCredentials) -> KerberosIdentity:
    """One identity (one credential cache, one ticket per service) per principal and
    keytab in the process, whoever logs in with it."""
    return KerberosIdentity(credentials)


class _SecurityContext:
    """A GSS-API security context (``target``: who is on the other side, for errors):
    what both sides do with it once it is established."""

    target: str

    def __init__(self) -> None:
        self._lib = gssapi_library()
        self._context = ctypes.c_void_p()

    def _wrap(self, data: bytes) -> bytes:
        lib, minor, out = self._lib, _OM(), _Buffer()
        given, keep = _in(data)
        major = lib.gss_wrap(ctypes.byref(minor), self._context, 0, _OM(0),
                             ctypes.byref(given), None, ctypes.byref(out))
        token = _taken(lib, out)
        _check(lib, major, minor, f"wrapping the security layer for {self.target}")
        del keep
        return token

    def _unwrap(self, data: bytes) -> bytes:
        lib, minor, out = self._lib, _OM(), _Buffer()
        given, keep = _in(data)
        major = lib.gss_unwrap(ctypes.byref(minor), self._context, ctypes.byref(given),
                               ctypes.byref(out), None, None)
        token = _taken(lib, out)
        _check(lib, major, minor, f"the security layer {self.target} offered")
        del keep
        return token

    def close(self) -> None:
        if self._context.value:
            self._lib.gss_delete_sec_context(ctypes.byref(_OM()), ctypes.byref(self._context),
                                             None)
            self._context = ctypes.c_void_p()

    def __del__(self) -> None:
        # An exchange its client left half way (the connection closed): freed with it.
        with contextlib.suppress(Exception):
            self.close()


class KerberosLogin(_SecurityContext):
    """One SASL GSSAPI exchange with the broker at ``host``: ``first()`` is the first
    token to send; ``step(challenge)`` the answer to each of the broker's, None once the
    exchange is over (the broker's next answer ends it).  Each call blocks (tickets);
    SaslError says why it failed."""

    def __init__(self, identity: KerberosIdentity, host: str) -> None:
        super().__init__()
        self.identity = identity
        self.target = f"{identity.credentials.service_name}@{host}"
        self._established = False
        self._answered_layers = False

    def first(self) -> bytes:
        return self._init(None)

    def step(self, challenge: bytes) -> bytes | None:
        if self._answered_layers:
            return None
        if not self._established:
            token = self._init(challenge)
            return token  # the context's last token may be empty: sent all the same
        # RFC 4752: the broker's wrapped offer (layers, maximum size); "none" chosen,
        # no authorization identity (the broker takes the principal's own).
        offer = self._unwrap(challenge)
        if len(offer) != 4 or not offer[0] & 1:
            raise SaslError(f"{self.target} offered no SASL security layer the proxy takes "
                            f"(offer {offer.hex()})")
        self._answered_layers = True
        return self._wrap(_NO_SECURITY_LAYER)

    def _init(self, challenge: bytes | None) -> bytes:
        lib, minor = self._lib, _OM()
        name = _import_name(lib, self.target, _NT_HOSTBASED_SERVICE,
                            f"the service name {self.target!r}")
        mechanism, keep_mechanism = _oid(_KRB5_MECHANISM)
        given, keep_given = _in(challenge or b"")
        out = _Buffer()
        try:
            major = lib.gss_init_sec_context(
                ctypes.byref(minor), self.identity.handle(), ctypes.byref(self._context), name,
                ctypes.byref(mechanism), _OM(_FLAGS), _OM(0), None,
                None if challenge is None else ctypes.byref(given), None,
                ctypes.byref(out), None, None)
            token = _taken(lib, out)
            _check(lib, major, minor, f"Kerberos login to {self.target} as "
                   f"{self.identity.credentials.principal!r}")
        finally:
            lib.gss_release_name(ctypes.byref(_OM()), ctypes.byref(name))
        del keep_mechanism, keep_given
        self._established = (major & 0xFFFF) != _GSS_S_CONTINUE_NEEDED
        return token




# -- the proxy as the Kerberos service clients log in to (sasl.downstream) ------------------


_krb5: Any = None


def default_realm() -> str:
    """krb5.conf's default_realm (KRB5_CONFIG's or /etc/krb5.conf's), as MIT's libkrb5
    reads it; SaslError if there is none."""
    global _krb5
    with _library_lock:
        if _krb5 is None:
            _krb5 = _load("krb5", "libkrb5.so.3", "GSSAPI needs MIT Kerberos's libkrb5.so.3 "
                          "(Debian: libkrb5-3; Red Hat: krb5-libs)")
            _krb5.krb5_get_default_realm.argtypes = [ctypes.c_void_p,
                                                     ctypes.POINTER(ctypes.c_char_p)]
    context = ctypes.c_void_p()
    if _krb5.krb5_init_context(ctypes.byref(context)):
        raise SaslError("Kerberos: krb5.conf could not be read (KRB5_CONFIG, /etc/krb5.conf)")
    realm = ctypes.c_char_p()
    try:
        if _krb5.krb5_get_default_realm(context, ctypes.byref(realm)) or realm.value is None:
            raise SaslError("Kerberos: krb5.conf names no default_realm")
        return realm.value.decode("utf-8", "replace")
    finally:
        if realm.value is not None:
            _krb5.krb5_free_default_realm(context, realm)
        _krb5.krb5_free_context(context)


_RULE = re.compile(
    r"DEFAULT|RULE:\[(\d+):([^\]]*)\](?:\(([^)]*)\))?(?:s/([^/]*)/([^/]*)/(g)?)?/?([LU])?")


@dataclass(frozen=True)
class PrincipalRule:
    """One rule of Kafka's ``sasl.kerberos.principal.to.local.rules`` (Hadoop's
    auth_to_local): ``DEFAULT``, or ``RULE:[n:format](match)s/pattern/replacement/g/L``."""

    text: str
    components: int = 0  # 0: DEFAULT
    template: str = ""
    match: re.Pattern[str] | None = None
    pattern: re.Pattern[str] | None = None
    replacement: str = ""
    every: bool = False
    case: str | None = None  # "L" lower, "U" upper

    def apply(self, realm: str, names: Sequence[str], local_realm: Callable[[], str]
              ) -> str | None:
        """The short name, or None when the rule does not apply (``local_realm``: the
        default realm, asked only by DEFAULT)."""
        if not self.components:
            return names[0] if realm == local_realm() else None
        if len(names) != self.components:
            return None
        base = re.sub(r"\$(\d)", lambda m: ([realm, *names][int(m.group(1))]
                                             if int(m.group(1)) <= len(names) else m.group(0)),
                      self.template)
        if self.match is not None and not self.match.fullmatch(base):
            return None
        if self.pattern is not None:
            base = self.pattern.sub(self.replacement, base, count=0 if self.every else 1)
        if re.search("[/@]", base):  # as Kafka: a rule must give a simple name
            raise SaslError(f"rule {self.text} turns the principal into {base!r}, not a "
                            "simple name")
        return base.lower() if self.case == "L" else base.upper() if self.case == "U" else base


def parse_principal_rules(rules: Sequence[str]) -> tuple[PrincipalRule, ...]:
    """ValueError naming a rule that is not one."""
    out = []
    for text in rules:
        found = _RULE.fullmatch(text.strip())
        if found is None:
            raise ValueError(f"{text!r} is not a principal rule (DEFAULT, or "
                             "RULE:[n:format](match)s/pattern/replacement/g/L as Kafka's "
                             "sasl.kerberos.principal.to.local.rules)")
        if text.strip() == "DEFAULT":
            out.append(PrincipalRule("DEFAULT"))
            continue
        count, template, match, pattern, replacement, every, case = found.groups()
        try:
            out.append(PrincipalRule(
                text.strip(), int(count), template,
                None if match is None else re.compile(match),
                None if pattern is None else re.compile(pattern),
                re.sub(r"\$(\d)", r"\\\1", replacement or ""), every == "g", case))
        except re.error as exc:
            raise ValueError(f"{text!r}: {exc}") from None
        if int(count) < 1:
            raise ValueError(f"{text!r}: a rule takes principals of 1 or more components")
    return tuple(out)


def short_name(principal: str, rules: Sequence[PrincipalRule],
               local_realm: Callable[[], str]) -> str:
    """The name Kafka's brokers give ``principal`` (``alice@EXAMPLE.COM`` -> ``alice``):
    the first rule that applies; SaslError if none does (a broker refuses the login)."""
    name, _, realm = principal.rpartition("@")
    names = name.split("/") if name else [principal]
    for rule in rules:
        result = rule.apply(realm, names, local_realm)
        if result is not None:
            return result
    raise SaslError(f"no principal rule applies to {principal} "
                    f"(rules: {', '.join(r.text for r in rules)})")


@dataclass(frozen=True)
class KerberosService:
    """Service keys (any principal in the keytab: every name clients may use for it),
    how principals become names, and the replay cache tickets are checked against
    (MIT's name for one: ``file2:/path``, ``none:``; None: MIT's default, a file in
    ``KRB5RCACHEDIR`` or ``/var/tmp``).  ``sasl.downstream.kerberos``: the proxy's
    own; ``sasl.passthrough_kerberos``: the brokers', to read who passes through."""

    keytab: Path
    rules: tuple[PrincipalRule, ...] = (PrincipalRule("DEFAULT"),)
    replay_cache: str | None = None
    principals: tuple[str, ...] = ()  # what the keytab held when the config was read


class KerberosAcceptor:
    """The acceptor credential from the service keytab, acquired once; thread-safe."""

    def __init__(self, service: KerberosService) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._handle: ctypes.c_void_p | None = None
        self._local_realm: str | None = None

    @property
    def local_realm(self) -> str:
        """The default realm (the DEFAULT rule's), read at the first login that asks."""
        if self._local_realm is None:
            self._local_realm = default_realm()
        return self._local_realm

    def handle(self) -> ctypes.c_void_p:
        with self._lock:
            if self._handle is None:
                store = {b"keytab": os.fsencode(self.service.keytab)}
                if self.service.replay_cache is not None:
                    store[b"rcache"] = os.fsencode(self.service.replay_cache)
                self._handle = _acquire(
                    gssapi_library(), None, _GSS_C_ACCEPT, store,
                    f"no service keys in keytab {str(self.service.keytab)!r}")
            return self._handle

    def user_of(self, principal: str) -> str:
        """The name the rules give ``principal`` (SaslError if none applies)."""
        return short_name(principal, self.service.rules, lambda: self.local_realm)

    def ticket_user(self, token: bytes) -> str:
        """The name of the client whose first GSSAPI token (its ticket for a service
        whose keys this keytab holds) is ``token``: a login passing through to a
        broker, read with the broker's keys and named by the broker's rules.  The
        broker answers the login; this context is thrown away.  SaslError says why the
        ticket cannot be read."""
        reading = KerberosAcceptance(self)
        try:
            reading.step(token)
            if reading.principal is None:
                raise SaslError("the client's Kerberos ticket needs more than one token")
            return self.user_of(reading.principal)
        finally:
            reading.close()


class KerberosAcceptance(_SecurityContext):
    """One client's GSSAPI login to the proxy, as a Kafka broker takes it (RFC 4752,
    server side): ``step(token)`` is ``(answer, done)``; once done, ``principal`` is
    the client's Kerberos principal and ``user`` its short name.  SaslError says why a
    login fails."""

    target = "the client"

    def __init__(self, acceptor: KerberosAcceptor) -> None:
        super().__init__()
        self.acceptor = acceptor
        self._established = False
        self._offered = False
        self.principal: str | None = None
        self.user: str | None = None

    def step(self, token: bytes) -> tuple[bytes, bool]:
        if not self._established:
            return self._accept(token), False
        if not self._offered:
            # The client's empty answer to the last context token: the offer, wrapped.
            self._offered = True
            return self._wrap(_NO_SECURITY_LAYER), False
        answer = self._unwrap(token)
        if len(answer) < 4 or not answer[0] & 1:
            raise SaslError(f"{self.principal} chose no security layer the proxy offered "
                            f"(answer {answer[:4].hex()})")
        # As Kafka: an authorization id, if any, changes nothing; the principal proved
        # is the one named.
        assert self.principal is not None
        self.user = self.acceptor.user_of(self.principal)
        return b"", True

    def _accept(self, token: bytes) -> bytes:
        lib, minor, out = self._lib, _OM(), _Buffer()
        given, keep = _in(token)
        source = ctypes.c_void_p()
        major = lib.gss_accept_sec_context(
            ctypes.byref(minor), ctypes.byref(self._context), self.acceptor.handle(),
            ctypes.byref(given), None, ctypes.byref(source), None, ctypes.byref(out), None,
            None, None)
        answer = _taken(lib, out)
        del keep
        try:
            _check(lib, major, minor, "the client's Kerberos ticket")
            if (major & 0xFFFF) != _GSS_S_CONTINUE_NEEDED:
                self._established = True
                name, ignored = _Buffer(), _OM()
                _check(lib, lib.gss_display_name(ctypes.byref(ignored), source,
                                                 ctypes.byref(name), None),
                       ignored, "the client's principal")
                self.principal = _taken(lib, name).decode("utf-8", "replace")
        finally:
            if source.value:
                lib.gss_release_name(ctypes.byref(_OM()), ctypes.byref(source))
        return answer


__all__ = [
    "DEFAULT_SERVICE_NAME",
    "GSSAPI",
    "KerberosAcceptance",
    "KerberosAcceptor",
    "KerberosCredentials",
    "KerberosIdentity",
    "KerberosLogin",
    "KerberosService",
    "PrincipalRule",
    "default_realm",
    "gssapi_library",
    "kerberos_identity",
    "keytab_principals",
    "parse_principal_rules",
    "short_name",
]
