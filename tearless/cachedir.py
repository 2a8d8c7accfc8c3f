"""Cached builds: a directory made once, keyed by the settings that determine it, reused after.

A build (an embedded task's warm-up model, its preference pairs, its process reward models) fills a
directory under a temporary name beside its final one and renames it into place only when complete, so
an interrupted build is never picked up and a second run reuses the finished one. The directory is
complete when its marker file (a JSON description of the build) exists: the marker is written last,
inside the temporary directory, and the rename makes both appear at once. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def default_cache_dir() -> Path:
    """``$TEARLESS_CACHE``, else ``$XDG_CACHE_HOME/tearless``, else ``~/.cache/tearless``."""
    if os.environ.get("TEARLESS_CACHE"):
        return Path(os.environ["TEARLESS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).expanduser().is_absolute() else Path.home() / ".cache"
    return base / "tearless"


def build_dir(cache_dir: str | os.PathLike | None, name: str, settings: dict[str, Any] | None = None) -> Path:
    """The final directory of the build ``name`` under ``cache_dir`` (None: :func:`default_cache_dir`),
    ``<name>-<settings_key(settings)>`` when the build has settings of its own."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    return root / (name if settings is None else f"{name}-{settings_key(settings)}")


def settings_key(settings: dict[str, Any]) -> str:
    """The cache key of a build: the first 12 hex digits of the SHA-256 of ``settings`` as JSON with
    sorted keys (so the order the settings were written in does not matter)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def cached_build(
    final: Path, marker: str, build: Callable[[Path], dict[str, Any]], *, fresh: bool = False
) -> dict[str, Any]:
    """The build's description, read from ``final / marker``; built first when that file is missing.

    ``build(tmp)`` writes the build's files into the empty directory ``tmp`` (``.<name>.tmp-<pid>``
    beside ``final``: another process's build of the same key uses another name) and returns the
    description, which is written to ``tmp / marker`` before ``tmp`` is renamed to ``final``. When
    another process renamed its build into place first, ours is dropped: theirs is as good. ``fresh``
    deletes a finished ``final`` first, so it is built again.
    """
    if fresh and final.exists():
        shutil.rmtree(final)
    if not (final / marker).is_file():
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        info = build(tmp)
        (tmp / marker).write_text(json.dumps(info, indent=1))
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same build first; theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
    return json.loads((final / marker).read_text())
