"""A checkpoint's checksum manifest, and the choice of the checkpoint to resume from.

:func:`write_manifest` records the size and SHA-256 of every file a checkpoint directory holds,
whatever they are (weights, tokenizer, trainer state, optimizer shards of other processes), in
``MANIFEST.json``; the checkpoint writer calls it after every other file and before the completion
marker. :func:`verify` re-reads every file the manifest names. :func:`checkpoint_to_resume` takes the
newest complete checkpoint whose files all match and reports each newer one that does not (one
flipped bit, a truncated or missing file), so a damaged newest checkpoint costs the steps since the
previous one, never a resume with wrong weights or a traceback.

A checkpoint written before manifests existed has none: it is resumed as before, with a warning. One
written by a version that writes manifests (its ``trainer_state.pt`` has a ``config`` or a
``format``: :data:`STATE_FORMAT`, which every checkpoint now carries) must have its manifest, listing
at least its trainer state and every file in the directory: deleting the manifest, emptying its file
list or dropping a file from it makes the checkpoint damaged, not unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

MANIFEST = "MANIFEST.json"
STATE = "trainer_state.pt"
# ``format`` in every trainer state written from now on: a checkpoint carrying it has a manifest.
STATE_FORMAT = {"manifest": 1}
_CHUNK = 1 << 20


class CheckpointDamaged(OSError):
    """A checkpoint's files do not match its manifest; the message lists what differs."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path, exclude: tuple[str, ...]) -> list[str]:
    found = []
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            if rel not in exclude:
                found.append(rel)
    return sorted(found)


def write_manifest(directory: str | os.PathLike, *, exclude: tuple[str, ...] = ()) -> Path:
    """Write ``MANIFEST.json`` listing every file under ``directory`` (but ``exclude``, relative
    paths) with its size and SHA-256; return its path."""
    directory = Path(directory)
    files = {
        rel: {"size": (directory / rel).stat().st_size, "sha256": _sha256(directory / rel)}
        for rel in _files(directory, (MANIFEST, *exclude))
    }
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump({"version": 1, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    return path


def verify(directory: str | os.PathLike, *, marker: str = "COMPLETE") -> list[str] | None:
    """What in ``directory`` differs from its manifest (empty: every file matches), or None when it
    has no manifest and was written before manifests (:func:`written_with_manifest`). Every file in
    the directory but the manifest and the completion ``marker`` (written after it) must be listed."""
    directory = Path(directory)
    try:
        with open(directory / MANIFEST) as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()
        ):
            raise TypeError("its file list is not {path: {size, sha256}}")
    except FileNotFoundError:
        era = written_with_manifest(directory)
        if era is None:
            return [f"{MANIFEST} is missing and {STATE} does not load as plain data (weights_only)"]
        if era:
            return [
                f"{MANIFEST} is missing, though this checkpoint was written by a tearless that writes one "
                "(its trainer state says so)"
            ]
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        return [f"{MANIFEST} is unreadable ({exc})"]
    if not files:
        return [f"{MANIFEST} lists no files"]
    problems = [
        f"{rel} is not in {MANIFEST}" for rel in _files(directory, (MANIFEST, marker)) if rel not in files
    ]
    if STATE not in files:
        problems.append(f"{MANIFEST} does not list {STATE}")
    for rel, expected in sorted(files.items()):
        path = directory / rel
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{rel} is missing")
            continue
        if size != expected["size"]:
            problems.append(f"{rel} has {size} bytes, {expected['size']} were written")
        elif _sha256(path) != expected["sha256"]:
            problems.append(f"{rel} does not match its checksum (changed on disk since it was written)")
    return problems


def written_with_manifest(directory: Path) -> bool | None:
    """Whether the checkpoint's trainer state shows a manifest-era writer: a ``format`` entry, or a
    ``config`` (added together with manifests); None when the state does not load as plain data (a
    truncated or hostile file: nothing vouches for the checkpoint). No state at all: False, not a
    checkpoint (the loader says so)."""
    if not (directory / STATE).is_file():
        return False
    try:
        state = torch.load(directory / STATE, weights_only=True, map_location="cpu")
    except Exception:  # unpickling refused or the file is cut: the caller reports it as damage
        return None
    return not isinstance(state, dict) or "format" in state or "config" in state


def checkpoint_to_resume(
    candidates: list[Path], *, from_path: str | os.PathLike | None = None, log: Callable[[str], None] = print
) -> Path | None:
    """The checkpoint to resume from: ``from_path`` if given (it must verify), else the newest of
    ``candidates`` (complete checkpoints, oldest first) whose files match their manifest.

    Each damaged newer checkpoint is reported through ``log``; :class:`CheckpointDamaged` is raised
    when ``from_path`` is damaged or every candidate is.
    """
    if from_path is not None:
        problems = verify(from_path)
        if problems:
            raise CheckpointDamaged(
                f"trainer.resume_from_path={str(from_path)!r} is damaged: {'; '.join(problems)}. Point it "
                "at an intact checkpoint (each global_step_N has its own MANIFEST.json)"
            )
        return Path(from_path)
    damaged = []
    for path in reversed(candidates):
        problems = verify(path)
        if problems is None:
            log(f"warning: {path} has no {MANIFEST} (written before checksums); resuming without checking it")
            return path
        if not problems:
            if damaged:
                log(f"resuming from {path} instead of the damaged {', '.join(p.name for p in damaged)}")
            return path
        damaged.append(path)
        log(f"checkpoint {path} is damaged and will not be resumed from: {'; '.join(problems)}")
    if damaged:
        raise CheckpointDamaged(
            f"every checkpoint in {damaged[0].parent} is damaged ({', '.join(p.name for p in damaged)}; see "
            "above); move them away to start over, or use another trainer.experiment_name"
        )
    return None
