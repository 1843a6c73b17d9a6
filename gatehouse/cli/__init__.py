"""The `gatehouse` command: run, check, demo, top, report, credential."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from gatehouse.configfile import ConfigError, Source
from gatehouse.logs import log_event, setup_logging

if TYPE_CHECKING:
    from gatehouse.proxy.config import ProxyConfig
    from gatehouse.proxy.kerberos import KerberosService

logger = logging.getLogger("gatehouse.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gatehouse", description="An inspecting proxy for the Kafka wire protocol."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the proxy")
    run.add_argument("--config", "-c", required=True, help="the proxy's YAML config")
    run.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (overrides the config)")
    run.add_argument("--log-json", action="store_true", help="log JSON lines")
    run.add_argument("--metrics-listen", metavar="HOST:PORT",
                     help="serve /metrics here (overrides metrics.listen; e.g. one port per "
                     "process of several sharing ports with reuse_port)")
    run.add_argument("--workers", type=int, metavar="N",
                     help="run N proxy processes on the same ports, supervised by this one "
                     "(overrides the config's workers)")
    # A worker of a supervisor (gatehouse.proxy.workers): its end of the socket pair.
    for hidden in ("--worker-fd", "--worker-index", "--worker-count", "--quota-fd",
                   "--connections-fd"):
        run.add_argument(hidden, type=int, help=argparse.SUPPRESS)

    check = sub.add_parser("check", help="validate a config (and its rules) without running")
    check.add_argument("--config", "-c", required=True)
    check.add_argument("--probe", action="store_true",
                       help="also connect to the bootstrap servers and every broker the "
                       "cluster lists as the proxy would (tls.upstream, sasl.upstream), "
                       "one line each; exit 1 if any does not answer")

    demo = sub.add_parser(
        "demo", help="an embedded broker, the proxy in front, a workload, and what it saw"
    )
    demo.add_argument("--duration", type=float, default=None,
                      help="stop after this many seconds (default: until Ctrl-C)")
    demo.add_argument("--port", type=int, default=0, help="proxy bootstrap port (default: any)")
    demo.add_argument("--log-level", default="WARNING")
    demo.add_argument("--every", type=float, default=5.0, help="seconds between summaries")

    top = sub.add_parser("top", help="a live terminal view of a proxy's /metrics")
    top.add_argument("--metrics", required=True, metavar="URL",
                     help="the proxy's metrics endpoint, e.g. http://127.0.0.1:9464/metrics")
    top.add_argument("--interval", type=float, default=2.0, help="seconds between scrapes")
    top.add_argument("--once", action="store_true",
                     help="print one view (rates over one interval) and exit")

    connections = sub.add_parser(
        "connections", help="the client connections a proxy holds now (its /connections)")
    connections.add_argument("--metrics", default="http://127.0.0.1:9464/metrics",
                             metavar="URL", help="the proxy's metrics endpoint (default: "
                             "%(default)s); its /connections is read")
    connections.add_argument("--sort", default="age", choices=("age", "bytes", "requests",
                                                               "idle", "owed", "errors",
                                                               "client"),
                             help="oldest, most bytes, most requests, longest idle, "
                             "waiting longest for an answer first, most errors, or by "
                             "client address (default: age)")
    connections.add_argument("--match", metavar="TEXT",
                             help="only connections whose client address, client id, "
                             "principal, software, listener or broker contains TEXT, or "
                             "a topic it produced to or fetched from, or an error it was "
                             "answered with")
    connections.add_argument("--limit", type=int, metavar="N", help="at most N rows")
    connections.add_argument("--json", action="store_true",
                             help="print the connections as JSON instead of a table")

    credential = sub.add_parser(
        "credential", help="a user's SCRAM credentials for sasl.downstream's users file "
        "(the password from stdin, or asked for)")
    credential.add_argument("user")
    credential.add_argument("--mechanism", action="append", choices=("SCRAM-SHA-256",
                            "SCRAM-SHA-512"), help="repeatable (default: both)")
    credential.add_argument("--iterations", type=int, default=8192,
                            help="PBKDF2 iterations (at least 4096; default 8192)")
    credential.add_argument("--file", metavar="USERS_FILE",
                            help="add the user to this users file (or replace it there), "
                            "creating the file, instead of printing the entry")

    report = sub.add_parser("report", help="capture files -> census, traffic and rule "
                            "impact tables and report.html (PySpark)")
    from gatehouse.pipeline.cli import add_arguments

    add_arguments(report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check":
        return _check(args.config, probe=args.probe)
    if args.command == "run":
        return _run(args)
    if args.command == "report":
        from gatehouse.pipeline.cli import main as report_main

        return report_main(args)
    if args.command == "top":
        from gatehouse.cli.top import run_top

        return run_top(args.metrics, interval=args.interval, once=args.once)
    if args.command == "connections":
        from gatehouse.cli.connections import run_connections

        return run_connections(args.metrics, sort=args.sort, match=args.match,
                               limit=args.limit, as_json=args.json)
    if args.command == "credential":
        return _credential(args.user, args.mechanism or ["SCRAM-SHA-256", "SCRAM-SHA-512"],
                           args.iterations, args.file)
    if args.command == "demo":
        from gatehouse.demo import run_demo

        setup_logging(args.log_level)
        return run_demo(duration=args.duration, port=args.port, every=args.every)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _credential(user: str, mechanisms: Sequence[str], iterations: int,
                file: str | None = None) -> int:
    """Print a users-file entry holding ``user``'s SCRAM credentials (never the
    password), the password read from stdin (one line) or asked for at a terminal; with
    ``file``, put it in that users file instead (the other users kept as they are)."""
    import getpass
    from pathlib import Path

    import yaml

    from gatehouse.codecs.scram import MAX_ITERATIONS, MIN_ITERATIONS, ScramCredential
    from gatehouse.proxy.sasl import load_users

    users: dict[str, object] = {}
    if file is not None and Path(file).exists():
        try:
            load_users(Path(file))  # a file the proxy would refuse is not edited
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        users = dict(yaml.safe_load(Path(file).read_text(encoding="utf-8"))["users"])

    if not MIN_ITERATIONS <= iterations <= MAX_ITERATIONS:
        print(f"error: --iterations must be from {MIN_ITERATIONS} to {MAX_ITERATIONS}",
              file=sys.stderr)
        return 1
    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {user}: ")
    else:
        password = sys.stdin.readline().rstrip("\r\n")
    if not password:
        print("error: empty password", file=sys.stderr)
        return 1
    entry = {m: ScramCredential.from_password(m, password, iterations=iterations).as_dict()
             for m in dict.fromkeys(mechanisms)}
    if file is None:
        print(yaml.safe_dump({"users": {user: entry}}, sort_keys=False), end="")
        return 0
    users[user] = entry
    path = Path(file)
    staged = path.with_name(f".{path.name}.new")
    staged.write_text(yaml.safe_dump({"users": users}, sort_keys=False), encoding="utf-8")
    # Credentials: readable by the owner only, unless the file was already shared.
    staged.chmod(path.stat().st_mode & 0o777 if path.exists() else 0o600)
    staged.replace(path)  # whole or not at all: a proxy watching it never reads half
    print(f"{file}: {user} ({', '.join(entry)}); {len(users)} user(s)")
    return 0


def _check(path: str, probe: bool = False) -> int:
    from gatehouse.proxy.setup import load_everything

    try:
        config, _policy = load_everything(path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{path}: ok (listen {config.listen}, upstream "
          f"{', '.join(map(str, config.upstream))})")
    from gatehouse.codecs._native import BYTE_READERS, python_reason

    print(f"byte readers: {BYTE_READERS}" + (f" ({python_reason})" if python_reason else ""))
    from gatehouse.metrics.tally import counting

    print(f"metrics counting: {'python' if counting is None else 'c'}")
    from gatehouse.capture.schema import native

    print(f"capture records: {'python' if native is None else 'c'}")
    if config.metrics_listen is not None:
        readers = {"local": "to loopback clients only", "any": "to whoever reaches it",
                   "off": "not served"}[config.metrics_connections]
        print(f"metrics.listen {config.metrics_listen}: /metrics, /healthz, /readyz; "
              f"/connections (who is connected) {readers} "
              f"(metrics.connections: {config.metrics_connections})")
    telemetry = config.client_telemetry
    if telemetry is not None:
        wanted = ("all their metrics" if telemetry.metrics == ("",) else
                  "metrics named " + ", ".join(f"{p}*" for p in telemetry.metrics))
        if not telemetry.receives:
            print(f"metrics.client_telemetry: the proxy reads what clients push to the "
                  f"brokers' own receiver (KIP-714), keeps {wanted}, exported as "
                  f"kafka_client_*, at most {telemetry.max_series:,} samples")
        else:
            print(f"metrics.client_telemetry: clients push {wanted} to the proxy every "
                  f"{telemetry.push_interval:g} s (KIP-714), exported as kafka_client_*, "
                  f"at most {telemetry.max_series:,} samples")
    for rule in _policy.ruleset.rules:
        encryption = rule.encrypt_records
        if encryption is not None:
            topics = ("every topic" if encryption.topics is None else "topics matching "
                      + ", ".join(p.pattern for p in encryption.topics))
            ring, kms = encryption.ring, encryption.kms
            count = 0 if ring is None else len(ring.keys)
            keys = "" if ring is None else (
                f"{ring.path} ({count} key{'s' if count != 1 else ''}, any of which decrypts)")
            if kms is None:
                under = f"key {encryption.key!r} of {keys}"
            else:
                if kms.type == "aws":
                    kind = "AWS KMS"
                    where = ", ".join(part for part in (
                        kms.region and f"region {kms.region}",
                        kms.endpoint and f"endpoint {kms.endpoint}") if part)
                    if importlib.util.find_spec("botocore") is None:
                        print(f"warning: rule {rule.name}: encrypt_records.kms needs "
                              "botocore: pip install 'kafka-gatehouse[aws]'", file=sys.stderr)
                else:
                    kind = f"the Vault transit engine at {kms.endpoint}/v1/{kms.mount}"
                    where = ", ".join(part for part in (
                        f"token from {kms.token_file or 'VAULT_TOKEN'}",
                        kms.namespace and f"namespace {kms.namespace}",
                        kms.ca_file and f"CA {kms.ca_file}") if part)
                    if kms.token_file is None and not os.environ.get("VAULT_TOKEN"):
                        print(f"warning: rule {rule.name}: encrypt_records.kms has no "
                              "token_file and VAULT_TOKEN is not set", file=sys.stderr)
                whose = "each topic's key" if kms.per_topic else "its key"
                under = (f"data keys made by {kind} under {whose} {kms.key!r}"
                         + (f" ({where})" if where else "")
                         + f", each KMS call bounded by {kms.timeout:g} s"
                         + (f"; older keys of {keys}" if ring is not None else ""))
            print(f"encrypt_records (rule {rule.name}): values of {topics} encrypted under "
                  f"{under}, for the clients the rule matches; the others read ciphertext")
    down, up = config.sasl_downstream, config.sasl_upstream
    if down is not None:
        from gatehouse.proxy.sasl import load_users

        lifetime = (f", session lifetime {down.session_lifetime:g} s"
                    if down.session_lifetime is not None else "")
        if down.users_file is not None:
            users = load_users(down.users_file)
            print(f"sasl.downstream: clients authenticate with the proxy as one of "
                  f"{len(users)} users of {down.users_file} "
                  f"({', '.join(m for m in down.mechanisms if m != 'OAUTHBEARER')}{lifetime})")
            written = sorted(name for name, user in users.items() if user.written_in)
            if written:
                print(f"warning: {down.users_file}: {', '.join(written)} keep their password "
                      "in the file itself (password:): anyone who reads it can log in as "
                      f"them; store SCRAM credentials instead (gatehouse credential NAME "
                      f"--file {down.users_file.name}) or use password_file / password_env",
                      file=sys.stderr)
        oauth = down.oauthbearer
        if oauth is not None and "OAUTHBEARER" in down.mechanisms:
            from gatehouse.proxy.oauth import load_jwks_file

            keys = (f"the {load_jwks_file(oauth.jwks_file).count} keys of {oauth.jwks_file}"
                    if oauth.jwks_file is not None else
                    f"the keys at {oauth.jwks_url} (fetched at start and every "
                    f"{oauth.jwks_refresh:g} s)")
            checks = "".join(
                f", {what} {value}" for what, value in (
                    ("issuer", oauth.expected_issuer),
                    ("audience", " or ".join(oauth.expected_audience) or None))
                if value is not None)
            print(f"sasl.downstream: OAUTHBEARER tokens checked against {keys}; the "
                  f"principal is their {oauth.principal_claim!r} claim{checks}; a session "
                  f"lasts no longer than its token{lifetime}")
        if down.kerberos is not None and "GSSAPI" in down.mechanisms:
            _check_kerberos_service(down.kerberos, "sasl.downstream.kerberos",
                                    "GSSAPI clients log in to {held}", lifetime)
    if config.sasl_passthrough_kerberos is not None:
        _check_kerberos_service(config.sasl_passthrough_kerberos, "sasl.passthrough_kerberos",
                                "GSSAPI clients passing through named from their tickets "
                                "for {held}", "")
    from gatehouse.proxy.oauth import OAuthClient

    if isinstance(up, OAuthClient):
        if up.aws_region is not None:
            source = (f"of Amazon MSK IAM in {up.aws_region}, signed with the "
                      + (f"{up.aws_profile!r} profile's" if up.aws_profile else "default")
                      + " AWS credentials")
        elif up.token_endpoint_url is not None:
            source = f"of client {up.client_id!r} from {up.token_endpoint_url}"
        else:
            source = f"read from {up.token_file}"
        print(f"sasl.upstream: the proxy authenticates to the brokers with OAUTHBEARER "
              f"tokens {source}")
    elif up is not None:
        print(f"sasl.upstream: the proxy authenticates to the brokers as {up.username!r} "
              f"({up.mechanism})")
    from gatehouse.proxy.config import security_warnings

    for warning in security_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    for advice in _policy.ruleset.advice(shared_identity=up is not None):
        print(f"warning: {advice}", file=sys.stderr)
    if probe:
        import trio

        from gatehouse.proxy.probe import probe_upstream
        from gatehouse.proxy.server import Proxy

        print("probe:")
        if not trio.run(probe_upstream, Proxy(config), lambda line: print(f"  {line}")):
            print("error: the probe found brokers the proxy cannot reach or log in to",
                  file=sys.stderr)
            return 1
        from gatehouse.proxy.kms import probe_kms

        for rule in _policy.ruleset.rules:
            encryption = rule.encrypt_records
            if encryption is not None and encryption.kms is not None:
                line, usable = probe_kms(encryption)
                print(f"  encrypt_records (rule {rule.name}): {line}")
                if not usable:
                    print(f"error: rule {rule.name}'s KMS makes or opens no data key: its "
                          "clients' records would wait for it", file=sys.stderr)
                    return 1
    return 0



def _check_kerberos_service(service: KerberosService, section: str, use: str,
                            lifetime: str) -> None:
    """What ``gatehouse check`` says of a Kerberos service section (``use``: what its
    keys, ``{held}``, are for): the principals, the rules, where accepted tickets are
    kept, the default realm (a warning if krb5.conf has none)."""
    from gatehouse.codecs.scram import SaslError
    from gatehouse.proxy.kerberos import default_realm

    held = service.principals
    cache = service.replay_cache
    kept = ("" if cache == "none:" else
            f"; tickets seen kept in {cache.removeprefix('file2:')}" if cache is not None else
            "; tickets seen kept in Kerberos's default replay cache")
    print(f"{section}: {use.format(held=', '.join(held))} (keys of {service.keytab}); "
          f"principals named by {', '.join(r.text for r in service.rules)}{kept}{lifetime}")
    try:
        print(f"{section}: the default realm (krb5.conf) is {default_realm()}")
    except SaslError as exc:
        print(f"warning: {section}: {exc}: the DEFAULT rule names no one "
              "(the logins it would name fail)", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from gatehouse.proxy.config import fixed_ports_problem, parse_address
    from gatehouse.proxy.setup import load_everything, run_configured

    try:
        config, policy = load_everything(args.config)
        if args.metrics_listen is not None:
            config = dataclasses.replace(config, metrics_listen=parse_address(
                args.metrics_listen, Source("--metrics-listen"), None, "--metrics-listen",
                default_host="127.0.0.1"))
        if args.workers is not None:
            problem = fixed_ports_problem(config.listen, config.brokers)
            if not 1 <= args.workers <= 256 or (args.workers > 1 and problem):
                raise ConfigError(f"more than one worker needs {problem}" if args.workers > 1
                                  else "must be from 1 to 256", file="--workers")
            config = dataclasses.replace(config, workers=args.workers,
                                         reuse_port=config.reuse_port or args.workers > 1)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    worker = args.worker_fd is not None
    if worker:
        config = _as_worker(config, args.worker_count or 1)
        setup_logging(args.log_level or config.log_level, args.log_json or config.log_json,
                      worker=args.worker_index)
    else:
        setup_logging(args.log_level or config.log_level, args.log_json or config.log_json)
        for advice in policy.ruleset.advice(
                shared_identity=config.sasl_upstream is not None):
            log_event(logger, logging.WARNING, "rules advice", advice=advice)
    try:
        if config.workers > 1:
            from gatehouse.proxy.workers import serve_workers

            passed = ["--config", args.config]
            passed += ["--log-level", args.log_level] if args.log_level else []
            passed += ["--log-json"] if args.log_json else []
            return serve_workers(config, passed)
        link = None
        host_counts = None
        if worker:
            from gatehouse.proxy.workers import SupervisorLink, take_cursor_key

            link = SupervisorLink(args.worker_fd)
            take_cursor_key()
            if args.quota_fd is not None:  # the supervisor's table: quotas shared
                from gatehouse.proxy.sharedquotas import SharedTable

                policy.quota_buckets.shared = SharedTable(args.quota_fd)
            if args.connections_fd is not None:  # connections per address: shared too
                from gatehouse.proxy.hostcounts import HostTable, SharedHostCounts

                host_counts = SharedHostCounts(
                    HostTable(args.connections_fd, args.worker_count or 1),
                    args.worker_index or 0)
        trio.run(run_configured, config, policy, args.config, link, host_counts)
    except KeyboardInterrupt:  # a second Ctrl-C while draining
        return 130
    except (OSError, BaseExceptionGroup) as exc:
        # A listener that cannot be opened (a port in use...): said plainly, not as a
        # traceback out of the nurseries it passed through.
        error = _os_error(exc)
        if error is None:
            raise
        log_event(logger, logging.ERROR, "proxy failed", error=error.strerror or str(error))
        return 1
    return 0


def _as_worker(config: ProxyConfig, count: int) -> ProxyConfig:
    """A worker's config: one process of ``count`` on shared ports, each keeping its
    share of the observation log's disk budget."""
    capture = config.capture
    if capture is not None:
        share = max(1, capture.max_total_bytes // count)
        # A file is at most the budget (as the config's own check requires).
        capture = dataclasses.replace(capture, max_total_bytes=share,
                                      rotate_bytes=min(capture.rotate_bytes, share))
    return dataclasses.replace(config, workers=1, reuse_port=True, capture=capture)


def _os_error(exc: BaseException) -> OSError | None:
    """``exc`` if it is an OSError, or the one OSError a group holds and nothing else."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None


async def handle_signals(proxy: object, reload: object = None) -> None:
    """SIGTERM/SIGINT drain the proxy; SIGHUP calls ``reload`` (rules and TLS certificates)."""
    from gatehouse.proxy.server import Proxy

    assert isinstance(proxy, Proxy)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                if callable(reload):
                    reload()
                continue
            if proxy.draining.is_set():
                raise KeyboardInterrupt
            log_event(logger, logging.INFO, "shutting down: draining connections",
                      signal=signal.Signals(signum).name,
                      grace_seconds=proxy.config.limits.shutdown_grace)
            proxy.shutdown()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
