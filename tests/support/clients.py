"""Real-client helpers shared by the integration tests (librdkafka via confluent-kafka,
and kafka-python)."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterable
from typing import Any

import confluent_kafka as ck

N = 10


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def produce(conf: dict[str, Any], topic: str, count: int = N, tag: str = "m") -> list[bytes]:
    """Produce ``count`` messages and wait for every delivery report; fail on any error."""
    producer = ck.Producer({**conf, "acks": "all", "linger.ms": 5, "log_level": 3})
    errors: list[Any] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(err)

    values = [f"{tag}-{i}".encode() for i in range(count)]
    for i, value in enumerate(values):
        producer.produce(topic, value=value, key=str(i).encode(), on_delivery=on_delivery)
    remaining = producer.flush(30)
    assert remaining == 0, f"{remaining} messages not delivered"
    assert errors == []
    return values


def round_trip(kafka: Any, bootstrap: str, prefix: str, count: int
               ) -> tuple[str, dict[str, Any], list[bytes]]:
    """A new topic of two partitions, ``count`` records produced to it through
    ``bootstrap`` and every one consumed back (asserted): the topic, the clients' config
    and the records."""
    topic = unique(prefix)
    kafka.create_topic(topic, partitions=2)
    conf = {"bootstrap.servers": bootstrap}
    sent = produce(conf, topic, count=count)
    assert sorted(consume(conf, topic, count)) == sorted(sent)
    return topic, conf, sent


def produce_for(conf: dict[str, Any], topic: str, seconds: float) -> int:
    """A librdkafka producer sending a record every 50 ms or so for ``seconds`` (across
    whatever happens meanwhile: re-authentication, sessions ending); how many it sent.
    Fails on any delivery failure or client error."""
    errors: list[Any] = []
    failed: list[Any] = []
    producer = ck.Producer({**conf, "acks": "all", "linger.ms": 5,
                            "error_cb": errors.append, "log_level": 0})
    sent = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        producer.produce(topic, f"r-{sent}".encode(),
                         on_delivery=lambda err, _m: err and failed.append(err))
        sent += 1
        producer.poll(0.05)
    assert producer.flush(30) == 0
    assert not failed and not errors, (failed, errors)
    return sent


def consume(conf: dict[str, Any], topic: str, count: int, timeout: float = 30.0,
            group: str = "g") -> list[bytes]:
    """Consume ``count`` messages of ``topic`` from the beginning, in a new consumer group
    (its id begins with ``group``)."""
    consumer = ck.Consumer({
        **conf,
        "group.id": unique(group),
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        # Tansu answers a first JoinGroup after about half the session timeout (45 s default)
        "session.timeout.ms": 6000,
        "log_level": 3,
    })
    got: list[bytes] = []
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + timeout
        while len(got) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got.append(msg.value())
    finally:
        consumer.close()
    return got





def produce_and_consume_for(bootstrap: str, topic: str, seconds: float
                            ) -> tuple[list[bytes], list[bytes]]:
    """A producer (acks=all) and a consumer of ``topic`` at ``bootstrap`` side by side
    for ``seconds``, then until the consumer has every record: (sent, consumed).  No
    delivery or client error may happen on the way (AssertionError naming them)."""
    errors: list[ck.KafkaError] = []
    failed: list[Any] = []
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "error_cb": errors.append,
                            "log_level": 0}
    producer = ck.Producer({**conf, "acks": "all", "linger.ms": 5})
    consumer = ck.Consumer({**conf, "group.id": unique("g"), "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    sent: list[bytes] = []
    got: list[bytes] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = f"r-{len(sent)}".encode()
        producer.produce(topic, value,
                         on_delivery=lambda err, _msg: err and failed.append(err))
        sent.append(value)
        producer.poll(0)
        message = consumer.poll(0.1)
        if message is not None and message.error() is None:
            got.append(message.value())
    assert producer.flush(30) == 0
    while len(got) < len(sent):
        message = consumer.poll(1.0)
        assert message is not None, f"{len(got)} of {len(sent)} consumed"
        if message.error() is None:
            got.append(message.value())
    consumer.close()
    assert not failed and not errors, (failed, errors)
    return sent, got

def watermarks(bootstrap: str, topic: str, partition: int = 0) -> tuple[int, int]:
    """The (low, high) offsets of one partition, as the broker at ``bootstrap`` has them."""
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": unique("g"),
                            "log_level": 0})
    try:
        low, high = consumer.get_watermark_offsets(ck.TopicPartition(topic, partition),
                                                   timeout=10)
    finally:
        consumer.close()
    return int(low), int(high)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from a blocking socket (fails if it closes first)."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed early"
        data += chunk
    return data


def aiokafka_produce(values: Iterable[bytes], topic: str, **client: Any) -> None:
    """``values`` produced by aiokafka, each acknowledged before the next (``client``:
    AIOKafkaProducer's arguments: bootstrap servers, security...)."""
    import asyncio

    from aiokafka import AIOKafkaProducer

    async def send_all() -> None:
        producer = AIOKafkaProducer(**client)
        await producer.start()
        try:
            for value in values:
                await producer.send_and_wait(topic, value)
        finally:
            await producer.stop()

    asyncio.run(send_all())


def kafka_python_produce(args: dict[str, Any], values: Iterable[bytes], topic: str) -> None:
    """``values`` produced by kafka-python (acks=all) with ``args`` (bootstrap servers,
    security...), every one acknowledged."""
    from kafka import KafkaProducer

    producer = KafkaProducer(**args, acks="all")
    try:
        for value in values:
            producer.send(topic, value)
        producer.flush(30)
    finally:
        producer.close(timeout=5)  # its threads go, whatever happened


def kafka_python_send_one(bootstrap: str, api_version: tuple[int, ...], topic: str
                          ) -> Exception | None:
    """One record sent by a kafka-python producer pinned to ``api_version``; the
    KafkaError that stopped it (a broker or proxy refusing that protocol level), or None.
    The record expires after 4 s, so that the producer can be closed either way: its
    sender thread would otherwise go on retrying into later tests (and draw from the
    random module under their Hypothesis strategies)."""
    from kafka import KafkaProducer
    from kafka.errors import KafkaError

    producer = None
    try:
        producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=api_version,
                                 max_block_ms=5000, request_timeout_ms=3000,
                                 delivery_timeout_ms=4000)
        producer.send(topic, b"x").get(timeout=10)
    except KafkaError as exc:
        return exc
    finally:
        if producer is not None:
            producer.close(timeout=10)
    return None


def kafka_python_read(args: dict[str, Any], topic: str, count: int,
                      timeout_ms: int = 15_000, *, group: str | None = None,
                      commit: bool = False) -> list[bytes]:
    """The first ``count`` values of ``topic`` (from the start), read by kafka-python
    with ``args`` in ``group`` (default a new one); fewer if ``timeout_ms`` passes
    without one.  ``commit``: what was read committed at the end (and only then)."""
    from kafka import KafkaConsumer

    committing = {"enable_auto_commit": False} if commit else {}
    reader = KafkaConsumer(topic, **args, auto_offset_reset="earliest",
                           consumer_timeout_ms=timeout_ms, group_id=group or unique("g"),
                           **committing)
    try:
        got = [m.value for m, _ in zip(reader, range(count), strict=False)]
        if commit:
            reader.commit()
        return got
    finally:
        reader.close()
