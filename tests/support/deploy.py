"""The deployment files under deploy/, as the tests read them: rendered kustomizations, the
Containerfile's instructions, and the gatehouse volume of a pod written out to a directory."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from tests.support.configmap import ConfigMapVolume

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
CONTAINERFILE = DEPLOY / "container" / "Containerfile"
KUSTOMIZATIONS = ("base/sidecar", "base/edge", "overlays/sidecar-example", "overlays/edge",
                  "overlays/edge-sni", "overlays/edge-tenants")
INSTALL_HINT = "install it with `sh scripts/install_deploy_tools.sh` (make test does)"


def cache_root() -> Path:
    root = os.environ.get("GATEHOUSE_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "gatehouse"


def tools_dir() -> Path:
    return cache_root() / "deploy-tools"


def kustomize_binary() -> Path:
    found = os.environ.get("GATEHOUSE_KUSTOMIZE") or tools_dir() / "bin" / "kustomize"
    path = Path(found)
    if not path.is_file():
        raise FileNotFoundError(f"no kustomize at {path}: {INSTALL_HINT}")
    return path


def render(kustomization: str) -> list[dict[str, Any]]:
    """``kustomize build`` of deploy/kubernetes/<kustomization>, as a list of objects."""
    result = subprocess.run([str(kustomize_binary()), "build", str(KUBERNETES / kustomization)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


# -- the Containerfile ---------------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str
    stage: int  # 0 = first FROM


def containerfile_instructions(path: Path = CONTAINERFILE) -> list[Instruction]:
    """The instructions, continuation lines joined, comments dropped."""
    out: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, arguments = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, arguments.strip(), stage))
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last = max(i.stage for i in instructions)
    return [i for i in instructions if i.stage == last]


def exec_form(arguments: str) -> list[str]:
    """A JSON-array (exec form) argument list; shell form is refused (signals, PID 1)."""
    value = json.loads(arguments)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), arguments
    return value


def entrypoint() -> list[str]:
    [found] = [i for i in final_stage(containerfile_instructions()) if i.keyword == "ENTRYPOINT"]
    return exec_form(found.arguments)


def image_user() -> int:
    [found] = [i for i in final_stage(containerfile_instructions()) if i.keyword == "USER"]
    return int(found.arguments.split(":")[0])


def healthcheck_command() -> list[str]:
    [found] = [i for i in final_stage(containerfile_instructions())
               if i.keyword == "HEALTHCHECK"]
    _, _, command = found.arguments.partition("CMD ")
    return exec_form(command)


# -- pods ----------------------------------------------------------------------------------

def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def gatehouse_container(pod: dict[str, Any]) -> dict[str, Any]:
    """The container running the gatehouse image (a native sidecar or a main container)."""
    candidates = [c for c in pod.get("initContainers", []) + pod["containers"]
                  if "gatehouse" in c["image"].rsplit("/", 1)[-1]]
    assert len(candidates) == 1, [c["name"] for c in candidates]
    return candidates[0]


def command_of(container: dict[str, Any]) -> list[str]:
    """What the container runs: its command, or the image's ENTRYPOINT, then its args."""
    return [*(container.get("command") or entrypoint()), *container.get("args", [])]


def config_path_of(container: dict[str, Any]) -> PurePosixPath:
    argv = command_of(container)
    assert "--config" in argv, shlex.join(argv)
    return PurePosixPath(argv[argv.index("--config") + 1])


def volume_at(pod: dict[str, Any], container: dict[str, Any], directory: PurePosixPath
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The (volumeMount, volume) that provides ``directory`` in the container."""
    [mount] = [m for m in container.get("volumeMounts", [])
               if PurePosixPath(m["mountPath"]) == directory]
    [volume] = [v for v in pod.get("volumes", []) if v["name"] == mount["name"]]
    return mount, volume


def volume_files(volume: dict[str, Any], objects: list[dict[str, Any]],
                 secret_data: dict[str, dict[str, bytes]]) -> dict[str, str | bytes]:
    """path -> content of a configMap/secret/projected volume, as the kubelet writes it.

    ConfigMaps come from the rendered ``objects``; Secrets (never rendered: operators create
    them) from ``secret_data``. A key an item names that the source lacks fails here, as the
    kubelet would fail the pod.
    """
    if "projected" in volume:
        sources = volume["projected"]["sources"]
    else:
        sources = [{k: v} for k, v in volume.items() if k in ("configMap", "secret")]
    files: dict[str, str | bytes] = {}
    for source in sources:
        [(kind, spec)] = [(k, v) for k, v in source.items() if k in ("configMap", "secret")]
        data: dict[str, str | bytes]
        if kind == "configMap":
            data = dict(find(objects, "ConfigMap", spec["name"])["data"])
        else:
            data = dict(secret_data[spec["name"]])
        items = spec.get("items") or [{"key": k, "path": k} for k in data]
        for item in items:
            assert item["key"] in data, f"{kind} {spec['name']} has no key {item['key']!r}"
            assert item["path"] not in files, f"two sources write {item['path']}"
            files[item["path"]] = data[item["key"]]
    return files


def write_volume(directory: Path, files: dict[str, str | bytes]) -> ConfigMapVolume:
    if directory.exists():
        shutil.rmtree(directory)
    volume = ConfigMapVolume(directory)
    volume.publish(files)
    return volume
