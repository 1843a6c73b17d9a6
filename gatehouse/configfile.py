"""YAML loading that remembers where each value came from, for file:line errors.

Both the proxy config and the rules are YAML; a user fixing a mistake wants
``rules.yaml:12: unknown API name 'Prodcue'``, not a traceback.  PyYAML's composer
keeps marks on nodes, so we build plain dicts and lists from the node tree and keep
the line of every mapping key and list item beside them.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gatehouse.codecs.scram import SaslCredentials


class ConfigError(Exception):
    """A config or rules file was rejected; ``str()`` is ``file:line: message``."""

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.line = line

    def __str__(self) -> str:
        where = self.file or "<config>"
        if self.line is not None:
            where = f"{where}:{self.line}"
        return f"{where}: {self.message}"


class LocatedDict(dict[str, Any]):
    """A mapping from YAML with the 1-based line of itself and of each key."""

    line: int
    key_lines: dict[str, int]


class LocatedList(list[Any]):
    """A sequence from YAML with the 1-based line of itself and of each item."""

    line: int
    item_lines: list[int]


@dataclass(frozen=True)
class Source:
    """Where a document came from: used to point errors at file:line."""

    file: str

    def error(self, message: str, line: int | None) -> ConfigError:
        return ConfigError(message, file=self.file, line=line)


_scalar_loader = yaml.SafeLoader("")


def _build(node: yaml.Node, file: str) -> Any:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = LocatedDict()
        out.line = line
        out.key_lines = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise ConfigError("YAML merge keys (<<) are not supported", file=file, line=line)
            key = _build(key_node, file)
            if not isinstance(key, str | int | float | bool) or isinstance(key, bool):
                raise ConfigError(
                    f"mapping keys must be plain names, not {key!r}",
                    file=file,
                    line=key_node.start_mark.line + 1,
                )
            key = str(key)
            if key in out:
                raise ConfigError(
                    f"duplicate key {key!r}", file=file, line=key_node.start_mark.line + 1
                )
            out[key] = _build(value_node, file)
            out.key_lines[key] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        seq = LocatedList()
        seq.line = line
        seq.item_lines = []
        for item in node.value:
            seq.append(_build(item, file))
            seq.item_lines.append(item.start_mark.line + 1)
        return seq
    return _scalar_loader.construct_object(node, deep=True)


def load_yaml_text(text: str, file: str = "<config>") -> Any:
    """Parse one YAML document into LocatedDict/LocatedList/scalars."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        raise ConfigError(f"not valid YAML: {exc.problem or exc}", file=file, line=line) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML: {exc}", file=file) from None
    except RecursionError:
        raise ConfigError("not a usable config: nested too deeply", file=file) from None
    if node is None:
        return LocatedDict()
    try:
        return _build(node, file)
    except RecursionError:
        raise ConfigError("not a usable config: nested too deeply", file=file,
                          line=node.start_mark.line + 1) from None


def load_yaml_file(path: str | Path) -> Any:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", file=str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: {exc.reason}", file=str(path)) from None
    return load_yaml_text(text, str(path))


def line_of(container: Any, key: str | int | None = None) -> int | None:
    """The line of ``container[key]`` (or of the container) if it came from YAML."""
    if key is not None:
        if isinstance(container, LocatedDict) and isinstance(key, str):
            return container.key_lines.get(key, container.line)
        if (
            isinstance(container, LocatedList)
            and isinstance(key, int)
            and 0 <= key < len(container.item_lines)
        ):
            return container.item_lines[key]
    return getattr(container, "line", None)


class Reader:
    """Typed access to a LocatedDict that raises ConfigError with file:line.

    ``take`` marks keys as read; ``finish`` rejects the keys nobody read, so a typo in a
    key is an error rather than silently ignored.
    """

    def __init__(self, data: Any, source: Source, what: str, line: int | None = None) -> None:
        if data is None:
            data = LocatedDict()
            data.line = line or 1
            data.key_lines = {}
        if not isinstance(data, dict):
            raise source.error(
                f"{what} must be a mapping, not {type(data).__name__}", line or line_of(data)
            )
        self.data = data
        self.source = source
        self.what = what
        self.seen: set[str] = set()

    @property
    def line(self) -> int | None:
        return line_of(self.data)

    def line_of(self, key: str) -> int | None:
        return line_of(self.data, key)

    def error(self, key: str | None, message: str) -> ConfigError:
        line = self.line_of(key) if key is not None else self.line
        return self.source.error(message, line)

    def has(self, key: str) -> bool:
        return key in self.data

    def take(self, key: str, types: type | tuple[type, ...], default: Any = None) -> Any:
        self.seen.add(key)
        if key not in self.data:
            return default
        value = self.data[key]
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise self.error(key, f"{self.what}.{key} must be {_type_names(types)}, not a boolean")
        if not isinstance(value, types):
            raise self.error(
                key,
                f"{self.what}.{key} must be {_type_names(types)}, not {_describe(value)}",
            )
        return value

    def require(self, key: str, types: type | tuple[type, ...]) -> Any:
        if key not in self.data:
            self.seen.add(key)
            raise self.error(None, f"{self.what} needs {key!r}")
        return self.take(key, types)

    def take_each(self, key: str, types: type | tuple[type, ...]
                  ) -> list[tuple[Any, int | None]] | None:
        """One value of ``types`` or a list of values, each with its line (an item of a
        block list: its own; else the key's), for a check that names the one it
        refuses; None when absent.  The items' own types are the caller's to check."""
        raw = self.take(key, (list, *_as_tuple(types)))
        if raw is None:
            return None
        if not isinstance(raw, list):
            return [(raw, self.line_of(key))]
        return [(item, line_of(raw, i) or self.line_of(key)) for i, item in enumerate(raw)]

    def take_networks(self, key: str, what: str
                      ) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
        """A CIDR (``10.0.0.0/8``; a bare address is a /32 or /128) or a list of them;
        None when absent.  ``what`` names the key in the error."""
        raw = self.take(key, (str, list))
        if raw is None:
            return None
        networks = []
        for item in [raw] if isinstance(raw, str) else raw:
            try:
                networks.append(ipaddress.ip_network(str(item), strict=False))
            except ValueError:
                raise self.error(key, f"{what}: {item!r} is not a CIDR (10.0.0.0/8, "
                                 "192.0.2.7)") from None
        return tuple(networks)

    def child(self, key: str) -> Reader:
        value = self.take(key, (dict, type(None)))
        return Reader(value, self.source, f"{self.what}.{key}", self.line_of(key))

    def finish(self) -> None:
        for key in self.data:
            if key not in self.seen:
                known = ", ".join(sorted(self.seen))
                raise self.error(key, f"unknown key {key!r} in {self.what} (known: {known})")


def read_sasl_credentials(reader: Reader, base: Path, mechanisms: Sequence[str]
                          ) -> SaslCredentials:
    """``{mechanism, username, password | password_file | password_env}``: what a client
    side authenticates with (``capture.kafka.sasl``, ``sasl.upstream``).  A relative
    password file is read from ``base``; no error text holds the password."""
    what = reader.what
    mechanism = reader.require("mechanism", str)
    if mechanism.upper() not in mechanisms:
        raise reader.error("mechanism", f"{what}.mechanism must be one of "
                           f"{', '.join(mechanisms)}, not {mechanism!r}")
    username = reader.require("username", str)
    if not username:
        raise reader.error("username", f"{what}.username must not be empty")
    password = take_password(reader, base)
    if password is None:
        raise reader.error(None, f"{what} needs exactly one of password, password_file, "
                           "password_env")
    reader.finish()
    return SaslCredentials(mechanism.upper(), username, password)


def take_password(reader: Reader, base: Path, key: str = "password") -> str | None:
    """The one of ``password``, ``password_file`` (relative to ``base``; one trailing
    line end dropped) or ``password_env`` that ``reader`` has; None if it has none.
    ``key`` names another secret read the same three ways (``client_secret``...)."""
    what = reader.what
    keys = (key, f"{key}_file", f"{key}_env")
    given = [k for k in keys if reader.has(k)]
    if len(given) > 1:
        raise reader.error(given[1], f"{what} needs exactly one of {', '.join(keys)}")
    if not given:
        return None
    source = given[0]
    value: str = reader.take(source, str)
    if source == keys[1]:
        path = Path(value) if Path(value).is_absolute() else base / value
        try:
            password = path.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise reader.error(source, f"{what}.{source}: cannot read {str(path)!r}: "
                               f"{getattr(exc, 'strerror', None) or exc}") from None
    elif source == keys[2]:
        password = os.environ.get(value, "")
    else:
        password = value
    if not password:
        hint = (f": the environment variable {value!r} is not set or empty"
                if source == keys[2] else " is empty")
        raise reader.error(source, f"{what}.{source}{hint}")
    return password


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


_TYPE_NAMES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true or false",
    dict: "a mapping",
    list: "a list",
    type(None): "empty",
}


def _type_names(types: type | tuple[type, ...]) -> str:
    return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in _as_tuple(types))


def _describe(value: Any) -> str:
    for t, name in _TYPE_NAMES.items():
        if type(value) is t:
            return f"{name} ({value!r})"[:80]
    return type(value).__name__


FileState = tuple[int, int, int, int] | None


def file_state(path: Path) -> FileState:
    """What tells a changed file from the one seen before.  Not the mtime alone: a
    Kubernetes ConfigMap or Secret update swaps a ``..data`` symlink to a new file,
    which can carry the old file's mtime (copied with it, or written in the same clock
    tick); the inode then tells them apart.  stat() follows the symlinks."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileWatch:
    """Whether any of some files changed (``file_state``) since the last look."""

    def __init__(self, paths: tuple[Path, ...]) -> None:
        self.paths = paths
        self._seen = self._states()

    def _states(self) -> tuple[FileState, ...]:
        return tuple(file_state(path) for path in self.paths)

    def changed(self) -> bool:
        """Whether a file changed since the last call (or since the watch began)."""
        seen = self._states()
        if seen != self._seen:
            self._seen = seen
            return True
        return False
