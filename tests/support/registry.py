"""A small Schema Registry for the unit tests: the part of Confluent's REST API that
the proxy's client uses (register a schema under a subject, read one by id and its subjects), on a real
socket, in a thread, showing what a real one does not: each request's path and
Authorization header (``seen``) and how often each id was asked for (``asked``).  The
integration tests use a real registry (tests/support/apicurio.py).  Ids are global, the
same schema registered again keeps its id, an unknown id is 404 with error_code 40403;
``stall()`` holds every answer until ``resume()``."""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections import Counter
from typing import Any

_SUBJECT_VERSIONS = re.compile(r"^/subjects/([^/?]+)/versions(\?.*)?$")
_SCHEMA_BY_ID = re.compile(r"^/schemas/ids/(\d+)(/subjects)?(\?.*)?$")
CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class TestRegistry:
    """``url``: the API's base.  Use as a context manager."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, base: str = "") -> None:
        """``base``: the path the API lies under (Apicurio's ``/apis/ccompat/v7``)."""
        self.schemas: dict[int, dict[str, Any]] = {}
        self.subjects: dict[int, set[str]] = {}  # each id's subjects
        self.asked: Counter[int] = Counter()
        self.seen: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _path(self) -> str | None:
                registry.seen.append((self.path, self.headers.get("Authorization")))
                registry._running.wait(60)
                return self.path[len(base):] if self.path.startswith(base + "/") else None

            def do_GET(self) -> None:
                path = self._path()
                found = None if path is None else _SCHEMA_BY_ID.match(path)
                if found is None:
                    return self._answer(404, {"error_code": 404, "message": "HTTP 404 Not Found"})
                schema_id = int(found.group(1))
                with registry._lock:
                    registry.asked[schema_id] += 1
                    schema = registry.schemas.get(schema_id)
                if schema is None:
                    return self._answer(404, {"error_code": 40403,
                                              "message": "Schema not found"})
                if found.group(2):
                    return self._answer(200, sorted(registry.subjects[schema_id]))
                body = {"schema": schema["schema"]}
                if schema.get("schemaType", "AVRO") != "AVRO":
                    body["schemaType"] = schema["schemaType"]
                self._answer(200, body)

            def do_POST(self) -> None:
                path = self._path()
                found = None if path is None else _SUBJECT_VERSIONS.match(path)
                if found is None:
                    return self._answer(404, {"error_code": 404, "message": "HTTP 404 Not Found"})
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                subject = found.group(1)
                schema_id = registry.register(subject, request["schema"],
                                              request.get("schemaType", "AVRO"))
                self._answer(200, {"id": schema_id, "subject": subject, "version": 1,
                                   "schema": request["schema"],
                                   "schemaType": request.get("schemaType", "AVRO")})

            def _answer(self, status: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.address = f"127.0.0.1:{self._server.server_address[1]}"
        self.url = f"http://{self.address}{base}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def register(self, subject: str, schema: str, schema_type: str = "JSON") -> int:
        """The id of ``schema`` (the same schema keeps its id)."""
        with self._lock:
            for schema_id, known in self.schemas.items():
                if known["schema"] == schema and known["schemaType"] == schema_type:
                    self.subjects[schema_id].add(subject)
                    return schema_id
            schema_id = len(self.schemas) + 1
            self.schemas[schema_id] = {"schema": schema, "schemaType": schema_type}
            self.subjects[schema_id] = {subject}
            return schema_id

    def stall(self) -> None:
        """Hold every answer (a registry that hangs) until ``resume``."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def __enter__(self) -> TestRegistry:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.resume()
        self._server.shutdown()
        self._server.server_close()
