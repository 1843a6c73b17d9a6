"""A Spark standalone cluster on 127.0.0.1 (a master and N workers), from pyspark's own
jars: what ``gatehouse report --master spark://...`` runs on in the tests and benchmarks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from scripts.fetch_kafka import java_binary
from tests.support.ports import free_port

SPARK_ENV = {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"}


class SparkStandalone:
    """``with SparkStandalone(work, workers=2, cores=1) as master: ...`` (``spark://…``).

    ``cpus``: per worker, the CPUs it and its executors may run on (``taskset -c``; the
    executors inherit it): what makes "1 core" mean one core, JIT and GC threads included.
    """

    def __init__(self, work: Path, *, workers: int = 1, cores: int = 2, memory: str = "1g",
                 cpus: list[str] | None = None) -> None:
        import pyspark

        self.home = Path(pyspark.__file__).parent
        self.work = work
        self.workers, self.cores, self.memory = workers, cores, memory
        self.cpus = cpus or [""] * workers
        assert len(self.cpus) == workers
        self.procs: list[subprocess.Popen[bytes]] = []

    def scala_version(self) -> str:
        (jar,) = (self.home / "jars").glob("scala-library-*.jar")
        return ".".join(jar.stem.removeprefix("scala-library-").split(".")[:2])

    def _start(self, name: str, main: str, *args: str, cpus: str = "") -> None:
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115
        pin = ["taskset", "-c", cpus] if cpus else []
        self.procs.append(subprocess.Popen(
            [*pin, java_binary(), "-Xmx256m", "-cp", f"{self.home / 'jars'}/*", main, *args],
            # SPARK_SCALA_VERSION: what the launcher would read from a build tree when the
            # worker builds its executors' command (pip installs have no build tree).
            env={**SPARK_ENV, "SPARK_HOME": str(self.home),
                 "SPARK_SCALA_VERSION": self.scala_version()},
            stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True))

    def __enter__(self) -> str:
        port, ui = free_port(), free_port()
        master = f"spark://127.0.0.1:{port}"
        self.work.mkdir(parents=True, exist_ok=True)
        self._start("Master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(port), "--webui-port", str(ui))
        for n in range(self.workers):
            self._start(f"Worker-{n}", "org.apache.spark.deploy.worker.Worker",
                        "--host", "127.0.0.1", "--cores", str(self.cores),
                        "--memory", self.memory, "--webui-port", str(free_port()),
                        "--work-dir", str(self.work / f"worker-{n}"), master,
                        cpus=self.cpus[n])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for proc in self.procs:
                assert proc.poll() is None, (self.work / "Master.log").read_text()[-2000:]
            try:
                state = json.load(urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/",
                                                         timeout=2))
                if state.get("aliveworkers", 0) >= self.workers:
                    return master
            except (OSError, ValueError):
                # ValueError: an HTML page, not JSON; the master's UI answers "/json/" with
                # its main page until the JSON handler is attached: not ready yet either.
                pass
            time.sleep(0.5)
        self.__exit__()
        raise AssertionError("the Spark workers did not register with the master")

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
