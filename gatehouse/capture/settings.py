"""The ``capture:`` section of the proxy config, parsed once into a frozen spec.

    capture:
      dir: /var/lib/gatehouse/capture    # required
      format: jsonl                      # or parquet (needs pyarrow: the parquet extra)
      gzip: false
      rotate_bytes: 67108864             # a new file after this many bytes ...
      rotate_seconds: 300                # ... or this many seconds, whichever first
      max_total_bytes: 1073741824        # the oldest files go when the total is above
      queue: 20000                       # records waiting for the disk; more are dropped
      instance: edge-1                   # default: the host name
      sample: {Fetch: 0.1, default: 1.0} # per-API share of exchanges recorded
      kafka: {topic: gatehouse.observations}  # also to a topic: capture/kafka_sink.py
"""

from __future__ import annotations

import math
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gatehouse.codecs import API_KEYS_BY_NAME
from gatehouse.configfile import Reader, line_of

if TYPE_CHECKING:
    from gatehouse.capture.kafka_sink import KafkaSinkSettings

MIB = 1024 * 1024
FORMATS = ("jsonl", "parquet")


@dataclass(frozen=True)
class CaptureSettings:
    dir: Path
    gzip: bool = False
    rotate_bytes: int = 64 * MIB
    rotate_seconds: float = 300.0
    max_total_bytes: int = 1024 * MIB
    queue: int = 20_000
    instance: str = field(default_factory=socket.gethostname)
    sample: dict[int, float] = field(default_factory=dict)  # api key -> share recorded
    sample_default: float = 1.0
    kafka: KafkaSinkSettings | None = None  # records also produced to a topic
    format: str = "jsonl"  # FORMATS

    def sample_rate(self, api_key: int) -> float:
        return self.sample.get(api_key, self.sample_default)


def _rate(value: Any, reader: Reader, line: int | None, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            0.0 <= float(value) <= 1.0 and math.isfinite(value)):
        raise reader.source.error(f"{what} must be a number from 0 to 1, not {value!r}", line)
    return float(value)


def _format(reader: Reader, gzip: bool) -> str:
    value: str = reader.take("format", str, "jsonl")
    if value not in FORMATS:
        raise reader.error("format", f"capture.format must be one of {', '.join(FORMATS)}, "
                           f"not {value!r}")
    if value == "parquet":
        if gzip:
            raise reader.error("gzip", "capture.gzip is for jsonl files; parquet files are "
                               "compressed column by column (zstd)")
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise reader.error("format", "capture.format parquet needs pyarrow, which is not "
                               "installed: pip install 'kafka-gatehouse[parquet]'") from None
    return value


def parse_capture(reader: Reader, base: Path) -> CaptureSettings:
    """``reader``: the ``capture`` mapping; raises ConfigError with file:line."""
    directory = Path(reader.require("dir", str))
    if not directory.is_absolute():
        directory = base / directory
    gzip = reader.take("gzip", bool, False)
    capture_format = _format(reader, gzip)

    def positive(key: str, default: float, integer: bool = True) -> Any:
        value = reader.take(key, (int,) if integer else (int, float), default)
        if value <= 0:
            raise reader.error(key, f"capture.{key} must be positive, not {value}")
        return value

    rotate_bytes = positive("rotate_bytes", CaptureSettings.rotate_bytes)
    rotate_seconds = float(positive("rotate_seconds", CaptureSettings.rotate_seconds, False))
    max_total = positive("max_total_bytes", CaptureSettings.max_total_bytes)
    if max_total < rotate_bytes:
        raise reader.error("max_total_bytes", "capture.max_total_bytes must be at least "
                           "capture.rotate_bytes (one whole file)")
    queue = positive("queue", CaptureSettings.queue)
    instance = reader.take("instance", str) or socket.gethostname()
    sample_raw = reader.take("sample", dict, {})
    sample: dict[int, float] = {}
    sample_default = 1.0
    for name, value in sample_raw.items():
        line = line_of(sample_raw, name)
        if name == "default":
            sample_default = _rate(value, reader, line, "capture.sample.default")
            continue
        key = API_KEYS_BY_NAME.get(name)
        if key is None:
            raise reader.source.error(f"capture.sample: unknown API name {name!r}", line)
        sample[key] = _rate(value, reader, line, f"capture.sample.{name}")
    kafka = None
    if reader.has("kafka"):
        from gatehouse.capture.kafka_sink import parse_kafka_sink

        kafka = parse_kafka_sink(reader.child("kafka"), base)
    reader.finish()
    return CaptureSettings(dir=directory, gzip=gzip, rotate_bytes=rotate_bytes,
                           rotate_seconds=rotate_seconds, max_total_bytes=max_total,
                           queue=queue, instance=instance, sample=sample,
                           sample_default=sample_default, kafka=kafka, format=capture_format)
