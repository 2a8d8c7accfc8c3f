"""Checkpoints that a crash can never leave half-written where resume would look.

Layout: ``<run_dir>/global_step_N/actor/`` is a ``save_pretrained`` directory (model + tokenizer,
loadable by ``AutoModelForCausalLM.from_pretrained`` alone); the RL trainer adds ``critic/`` and
``optim/<role>/`` (optimizer state in safetensors shards, :mod:`tearless.workers.optim_state`, the
same for every placement and world size); ``trainer_state.pt`` holds the scheduler, RNG states, KL
controller and step (the offline trainers keep their optimizer state there too). A checkpoint is
written under a hidden temporary name and renamed into place only when complete;
``latest_checkpointed_iteration.txt`` is rewritten atomically afterwards. Resume trusts only
directories named ``global_step_N`` that hold the completion marker.

``MANIFEST.json`` (written after every other file, before the marker) holds each file's size and
SHA-256; resume verifies it and falls back to the previous checkpoint when the newest is damaged
(:func:`checkpoint_to_resume`).

Every file of a checkpoint is fsynced before the rename, so the rename publishes data that is on
disk, not only in the page cache. A save that fails (disk full, no permission, file size limit)
removes its temporary directory and raises :class:`CheckpointError`, which says what failed and
which checkpoint is still the latest; the previous checkpoints are never touched before the new
one is complete. Debris that a killed process left (hidden ``.….tmp-<pid>`` entries of processes
that no longer run) is removed by the next save.

``trainer_state.pt`` holds only tensors and plain Python values and is read with
``torch.load(weights_only=True)``, and the optimizer shards are safetensors with a JSON index:
loading a checkpoint never unpickles arbitrary objects, in any placement.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tearless import faults
from tearless.models.loading import quiet_transformers
from tearless.run.manifest import STATE_FORMAT, write_manifest
from tearless.run.manifest import CheckpointDamaged as CheckpointDamaged
from tearless.run.manifest import checkpoint_to_resume as _choose

MARKER = "COMPLETE"
TRACKER = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_DEBRIS = re.compile(r"^\..+\.(?:tmp|trash)-(\d+)$")


class CheckpointError(OSError):
    """A checkpoint could not be written; the message names the cause and the checkpoint still in charge.

    ``errno`` is the operating system's error code (``errno.ENOSPC`` for a full disk, …)."""

    def __init__(self, code: int | None, message: str) -> None:
        super().__init__(message)
        self.errno = code


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    state: dict[str, Any],
    model: Any = None,
    tokenizer: Any = None,
    keep: int | None = None,
    extra_models: dict[str, torch.nn.Module] | None = None,
    write: Callable[[Path], dict[str, Any] | None] | None = None,
) -> Path:
    """Write ``global_step_{step}`` atomically; prune to the newest ``keep`` complete checkpoints.

    ``model`` is anything with ``save_pretrained(directory)``, saved as ``actor/``; ``tokenizer`` may be
    None for models without one (the flow models). ``extra_models`` (e.g. ``{"critic": value_model}``)
    are saved as ``save_pretrained`` directories beside it. ``write(directory)`` adds what other code
    (the RL trainer's workers, in this process or others) writes inside the temporary directory, so
    it too appears only when complete; what it returns is added to ``state``.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_debris(run_dir)
    final = run_dir / f"global_step_{step}"
    tmp = run_dir / f".global_step_{step}.tmp-{os.getpid()}"
    trash = run_dir / f".global_step_{step}.trash-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        with quiet_transformers():
            if model is not None:
                model.save_pretrained(tmp / "actor")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "actor")
            for name, extra in (extra_models or {}).items():
                extra.save_pretrained(tmp / name)
        if write is not None:
            state = {**state, **(write(tmp) or {})}
        faults.point("checkpoint_write", step)
        # Through a Python file object, so a failed write raises its OSError (torch's own writer
        # reports "unexpected pos" and loses the errno).
        with open(tmp / "trainer_state.pt", "wb") as f:
            torch.save({**state, "format": STATE_FORMAT}, f)
        write_manifest(tmp)  # after every other file, before the marker: it covers them all
        (tmp / MARKER).write_text(str(step))
        _fsync_tree(tmp)
        if final.exists():  # a checkpoint of the same step from an earlier, interrupted run
            os.replace(final, trash)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        code = os_errno(exc)
        if code is None:
            raise
        raise _save_error(run_dir, step, exc, code) from exc
    shutil.rmtree(trash, ignore_errors=True)
    faults.point("checkpoint_rename", step)
    try:
        _atomic_write_text(run_dir / TRACKER, str(step))
    except OSError as exc:
        # The checkpoint itself is complete (resume finds it by its marker); only the pointer is stale.
        raise CheckpointError(
            exc.errno,
            f"checkpoint {final} was saved, but updating {run_dir / TRACKER} failed ({exc}); resume "
            "still finds the new checkpoint. Free disk space or fix the permissions of the run directory",
        ) from exc
    if keep is not None and keep > 0:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def os_errno(exc: BaseException) -> int | None:
    """The errno behind a failed write: of an ``OSError``, of one in the exception's cause/context
    chain (torch wraps it in a RuntimeError), or the ``(os error N)`` that safetensors puts in its
    message. ``None`` when the failure was not the operating system's."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        match = _OS_ERROR.search(str(exc))
        if match:
            return int(match.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def _save_error(run_dir: Path, step: int, exc: BaseException, code: int) -> CheckpointError:
    latest = latest_checkpoint(run_dir)
    still = f"the latest complete checkpoint is still {latest}" if latest else "no earlier checkpoint exists"
    hints = {
        errno.ENOSPC: "free disk space or point trainer.default_local_dir at a larger disk",
        errno.EDQUOT: "free space within your disk quota or use another trainer.default_local_dir",
        errno.EFBIG: "a file size limit (ulimit -f) stops the write; raise it",
        errno.EACCES: "make trainer.default_local_dir writable or point it elsewhere",
        errno.EPERM: "make trainer.default_local_dir writable or point it elsewhere",
        errno.EROFS: "the file system is read-only; point trainer.default_local_dir at a writable one",
    }
    hint = hints.get(code, "check the disk and trainer.default_local_dir")
    return CheckpointError(
        code,
        f"saving checkpoint global_step_{step} in {run_dir} failed ([Errno {code}] {os.strerror(code)}: "
        f"{exc}); nothing of it was left "
        f"behind and {still}. Fix: {hint}, then rerun with trainer.resume_mode=auto to continue",
    )


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_debris(run_dir: str | os.PathLike) -> list[Path]:
    """Remove the hidden temporary entries (``.global_step_N.tmp-<pid>``, …) of processes that are gone.

    A SIGKILL mid-save leaves them; they are never resumed from, but they hold disk space. Entries of a
    process that still runs (another trainer writing here) are left alone. Returns what was removed.
    """
    removed = []
    for child in Path(run_dir).iterdir():
        match = _DEBRIS.match(child.name)
        if not match or _alive(int(match.group(1))):
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
        removed.append(child)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # this process's own leftovers are from an earlier, failed save
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete ``global_step_N`` directories of ``run_dir``, oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / MARKER).is_file():
            found.append((int(match.group(1)), child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def checkpoint_to_resume(
    run_dir: str | os.PathLike, from_path: str | os.PathLike | None = None, log: Callable[[str], None] = print
) -> Path | None:
    """``from_path`` if given, else the newest complete checkpoint of ``run_dir`` whose files match its
    checksum manifest (damaged newer ones are reported and skipped; see :mod:`tearless.run.manifest`)."""
    return _choose(complete_checkpoints(run_dir), from_path=from_path, log=log)


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """The trainer state of a checkpoint directory, with a clear error if it is not one."""
    path = Path(path)
    if not (path / MARKER).is_file() or not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete tearless checkpoint (no {MARKER} marker or "
            "trainer_state.pt); point trainer.resume_from_path at a global_step_N directory"
        )
    state_file = path / "trainer_state.pt"
    try:
        return torch.load(state_file, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        # torch's own message advises weights_only=False, which would run whatever the file holds
        # and cannot mend a cut file: name the file and the way out instead.
        what = (
            "holds objects other than tensors and plain data (refused: loading them could run code)"
            if "Weights only load failed" in str(e)
            else f"is truncated or damaged ({type(e).__name__})"
        )
        raise CheckpointDamaged(
            f"{state_file} {what}; resume from an earlier checkpoint with trainer.resume_mode=resume_path "
            "trainer.resume_from_path=<run dir>/global_step_N, or start afresh with "
            "trainer.resume_mode=disable"
        ) from None
