"""Pure, sans-I/O codecs for the Kafka wire protocol, generated from Kafka's specs.

The façade::

    from gatehouse import codecs
    req = codecs.decode_request(frame)           # frame = bytes after the size prefix
    resp = codecs.decode_response(frame, api_key=3, api_version=12)
    codecs.encode_request(req); codecs.encode_response(resp)
    plain = codecs.to_dict(req)                  # {"header": {...}, "body": {...}}
    codecs.request_from_dict(plain); codecs.response_from_dict(plain, api_key=, api_version=)

Headers are decoded eagerly, bodies on first access (``req.body``), and an unchanged
message encodes as its original bytes.  Arrays are tuples, except arrays of three or
more number-only structs (Metadata's partitions): those are ``FlatRecords``, a read-only
sequence equal to the tuple of its records that an unchanged message writes back as its
bytes (the C decoder, ``_decoder.c``, builds the records at once; the generated Python
decoder checks the bytes and builds them when first read).  Every error is a
``ProtocolError``.
"""

from gatehouse.codecs import consumer, records
from gatehouse.codecs._flat import FlatRecords
from gatehouse.codecs.errors import (
    FrameTooLarge,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    UnknownApi,
)
from gatehouse.codecs.frames import (
    Request,
    RequestHeader,
    Response,
    ResponseHeader,
    decode_request,
    decode_request_header,
    decode_response,
    encode_request,
    encode_response,
    size_prefixed,
    throttle_time_at,
)
from gatehouse.codecs.plain import request_from_dict, response_from_dict, to_dict
from gatehouse.codecs.reader import DEFAULT_MAX_FRAME_SIZE, FrameReader
from gatehouse.codecs.schema import (
    API_KEYS_BY_NAME,
    APIS,
    KAFKA_RELEASE,
    MESSAGES,
    ApiSpec,
    FieldSpec,
    MessageSpec,
    Record,
    StructSpec,
    Versions,
    api,
    api_name,
)

__all__ = [
    "APIS",
    "API_KEYS_BY_NAME",
    "DEFAULT_MAX_FRAME_SIZE",
    "KAFKA_RELEASE",
    "MESSAGES",
    "ApiSpec",
    "FieldSpec",
    "FlatRecords",
    "FrameReader",
    "FrameTooLarge",
    "LocalProtocolError",
    "MessageSpec",
    "ProtocolError",
    "Record",
    "RemoteProtocolError",
    "Request",
    "RequestHeader",
    "Response",
    "ResponseHeader",
    "StructSpec",
    "UnknownApi",
    "Versions",
    "api",
    "api_name",
    "consumer",
    "decode_request",
    "decode_request_header",
    "decode_response",
    "encode_request",
    "encode_response",
    "records",
    "request_from_dict",
    "response_from_dict",
    "size_prefixed",
    "throttle_time_at",
    "to_dict",
]
