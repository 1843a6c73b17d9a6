"""A small Schema Registry for the unit tests: the part of Confluent's REST API that
the proxy's client uses (register a schema under a subject, with references to others;
read one by id, its subjects, a subject's version), on a real socket, in a thread, showing what a real one does not: each request's path and
Authorization header (``seen``) and how often each id was asked for (``asked``).  The
integration tests use a real registry (tests/support/apicurio.py).  Ids are global, the
same schema registered again keeps its id, an unknown id is 404 with error_code 40403,
an unknown subject 40401, an unknown version 40402; ``stall()`` holds every answer
until ``resume()``; a subject in ``broken`` is answered HTTP 500."""

from __future__ import annotations

import http.server
import json
import re
import threading
import urllib.parse
from collections import Counter
from typing import Any

_SUBJECT_VERSIONS = re.compile(r"^/subjects/([^/?]+)/versions(\?.*)?$")
_SCHEMA_BY_ID = re.compile(r"^/schemas/ids/(\d+)(/subjects)?(\?.*)?$")
_SUBJECT_VERSION = re.compile(r"^/subjects/([^/?]+)/versions/([^/?]+)$")
CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class TestRegistry:
    """``url``: the API's base.  Use as a context manager."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, base: str = "") -> None:
        """``base``: the path the API lies under (Apicurio's ``/apis/ccompat/v7``)."""
        self.schemas: dict[int, dict[str, Any]] = {}
        self.subjects: dict[int, set[str]] = {}  # each id's subjects
        self.versions: dict[str, list[int]] = {}  # each subject's ids, version 1 first
        self.broken: set[str] = set()
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
                version = None if path is None else _SUBJECT_VERSION.match(path)
                if version is not None:
                    return self._version(urllib.parse.unquote(version.group(1)),
                                         version.group(2))
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
                self._answer(200, registry.body(schema_id))

            def _version(self, subject: str, version: str) -> None:
                if subject in registry.broken:
                    return self._answer(500, {"error_code": 50001, "message": "broken"})
                ids = registry.versions.get(subject)
                if ids is None:
                    return self._answer(404, {"error_code": 40401,
                                              "message": f"Subject '{subject}' not found."})
                index = len(ids) if version == "latest" else int(version)
                if not 0 < index <= len(ids):
                    return self._answer(404, {"error_code": 40402,
                                              "message": f"Version {version} not found."})
                self._answer(200, {"subject": subject, "version": index, "id": ids[index - 1],
                                   **registry.body(ids[index - 1])})

            def do_POST(self) -> None:
                path = self._path()
                found = None if path is None else _SUBJECT_VERSIONS.match(path)
                if found is None:
                    return self._answer(404, {"error_code": 404, "message": "HTTP 404 Not Found"})
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                subject = found.group(1)
                schema_id = registry.register(subject, request["schema"],
                                              request.get("schemaType", "AVRO"),
                                              request.get("references"))
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

    def register(self, subject: str, schema: str, schema_type: str = "JSON",
                 references: list[dict[str, Any]] | None = None) -> int:
        """The id of ``schema`` (the same schema keeps its id), a new version of
        ``subject``; ``references``: ``{name, subject, version}`` of the schemas it
        refers to."""
        with self._lock:
            for schema_id, known in self.schemas.items():
                if known["schema"] == schema and known["schemaType"] == schema_type:
                    self.subjects[schema_id].add(subject)
                    break
            else:
                schema_id = len(self.schemas) + 1
                self.schemas[schema_id] = {"schema": schema, "schemaType": schema_type,
                                           "references": references or []}
                self.subjects[schema_id] = {subject}
            versions = self.versions.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
            return schema_id

    def body(self, schema_id: int) -> dict[str, Any]:
        """What the registry answers for ``schema_id``: its text, type (unless Avro)
        and references (if any)."""
        schema = self.schemas[schema_id]
        body: dict[str, Any] = {"schema": schema["schema"]}
        if schema["schemaType"] != "AVRO":
            body["schemaType"] = schema["schemaType"]
        if schema["references"]:
            body["references"] = schema["references"]
        return body

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
