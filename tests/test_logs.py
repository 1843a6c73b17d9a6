"""Structured log lines (gatehouse.logs): a field's value, whatever a client put in it,
stays inside its one line."""

from __future__ import annotations

import json
import logging

import pytest

from gatehouse.logs import FIELDS_ATTR, JsonFormatter, TextFormatter


def record(**fields: object) -> logging.LogRecord:
    made = logging.LogRecord("gatehouse.proxy", logging.INFO, __file__, 1,
                             "connection closed", None, None)
    setattr(made, FIELDS_ATTR, fields)
    return made


@pytest.mark.parametrize(("value", "shown"), [
    ("plain-id", "client_id=plain-id"),
    ("two words", 'client_id="two words"'),
    ("", 'client_id=""'),
    ('a"b', 'client_id="a\\"b"'),
    ("k=v", 'client_id="k=v"'),
    # A newline would forge a log line; ESC would drive the terminal tailing the log.
    ("app\n2026-12-06T00:00:00.000Z ERROR forged", 'client_id="app\\n2026-12-06T00'),
    ("app\x1b[2J\x1b]0;pwned\x07", 'client_id="app\\u001b[2J\\u001b]0;pwned\\u0007"'),
    ("app\tx\rx\x9bx", 'client_id="app\\tx\\rx\\u009bx"'),
])
def test_a_text_line_holds_a_clients_value_within_its_field(value: str, shown: str) -> None:
    line = TextFormatter().format(record(client_id=value, bytes_in=10))
    assert shown in line
    assert "\n" not in line and "\x1b" not in line and "\x07" not in line
    assert line.endswith(" bytes_in=10")
    # The JSON lines keep the value itself.
    assert json.loads(JsonFormatter().format(record(client_id=value)))["client_id"] == value
