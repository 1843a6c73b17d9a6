"""A directory laid out the way the kubelet lays out a mounted ConfigMap (or projected) volume.

The kubelet never rewrites a file in place. Each update is written into a new hidden
directory named after the time, a ``..data_tmp`` symlink to it is renamed over ``..data``
(one atomic rename), the visible names are symlinks through ``..data``, and the previous
directory is removed afterwards::

    gatehouse.yaml -> ..data/gatehouse.yaml
    rules.yaml     -> ..data/rules.yaml
    ..data         -> ..2026_11_23_07_10_01.000123456
    ..2026_11_23_07_10_01.000123456/{gatehouse.yaml,rules.yaml}
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path


class ConfigMapVolume:
    """``publish(files)`` swaps in a new version of all files, as a ConfigMap update does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.versions = 0

    @property
    def data(self) -> Path:
        return self.root / "..data"

    def publish(self, files: Mapping[str, str | bytes], *, keep_mtime: bool = False) -> Path:
        """Write ``files`` (relative paths) as the volume's new content; returns its directory.

        ``keep_mtime``: give every new file the mtime of the file it replaces (as a copy that
        preserves times would), so only the file's identity tells the versions apart.
        """
        previous = self.data.resolve() if self.data.is_symlink() else None
        stamp = datetime.now(UTC).strftime("%Y_%m_%d_%H_%M_%S")
        version = self.root / f"..{stamp}.{time.time_ns() % 10**9:09d}{self.versions:03d}"
        self.versions += 1
        version.mkdir()
        for name, content in files.items():
            path = version / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
            old = None if previous is None else previous / name
            if keep_mtime and old is not None and old.exists():
                stat = old.stat()
                os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        tmp_link = self.root / "..data_tmp"
        tmp_link.symlink_to(version.name)
        tmp_link.rename(self.data)  # the atomic swap
        tops = {Path(name).parts[0] for name in files}
        for top in tops:
            visible = self.root / top
            if not visible.is_symlink():
                visible.symlink_to(f"..data/{top}")
        for entry in self.root.iterdir():  # names the new version no longer has
            if entry.is_symlink() and not entry.name.startswith("..") and entry.name not in tops:
                entry.unlink()
        if previous is not None:
            shutil.rmtree(previous)
        return version
