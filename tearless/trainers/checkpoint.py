"""Checkpoints that a crash can never leave half-written where resume would look.

Layout: ``<run_dir>/global_step_N/actor/`` is a ``save_pretrained`` directory (model + tokenizer,
loadable by ``AutoModelForCausalLM.from_pretrained`` alone); ``trainer_state.pt`` holds the
optimizer, scheduler, RNG states, KL controller and step. A checkpoint is written under a hidden
temporary name and renamed into place only when complete; ``latest_checkpointed_iteration.txt``
is rewritten atomically afterwards. Resume trusts only directories named ``global_step_N`` that
hold the completion marker.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tearless.models.loading import quiet_transformers

MARKER = "COMPLETE"
TRACKER = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    run_dir: str | os.PathLike,
    step: int,
    *,
    model: Any,
    tokenizer: Any,
    state: dict[str, Any],
    keep: int | None = None,
    extra_models: dict[str, torch.nn.Module] | None = None,
    write_shards: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``global_step_{step}`` atomically; prune to the newest ``keep`` complete checkpoints.

    ``model`` is anything with ``save_pretrained(directory)``; ``tokenizer`` may be None for models
    without one (the flow models). ``extra_models`` (e.g. ``{"critic": value_model}``) are saved as
    ``save_pretrained`` directories beside ``actor/``. ``write_shards(directory)`` adds files written by
    other processes (the Ray workers' optimizer shards) inside the temporary directory, so they too
    appear only when complete.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / f"global_step_{step}"
    tmp = run_dir / f".global_step_{step}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        with quiet_transformers():
            model.save_pretrained(tmp / "actor")
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / "actor")
            for name, extra in (extra_models or {}).items():
                extra.save_pretrained(tmp / name)
        if write_shards is not None:
            write_shards(tmp)
        torch.save(state, tmp / "trainer_state.pt")
        (tmp / MARKER).write_text(str(step))
        if final.exists():  # a checkpoint of the same step from an earlier, interrupted run
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _atomic_write_text(run_dir / TRACKER, str(step))
    if keep is not None and keep > 0:
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


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


def load_state(path: str | os.PathLike) -> dict[str, Any]:
    """The trainer state of a checkpoint directory, with a clear error if it is not one."""
    path = Path(path)
    if not (path / MARKER).is_file() or not (path / "trainer_state.pt").is_file():
        raise FileNotFoundError(
            f"{path} is not a complete tearless checkpoint (no {MARKER} marker or "
            "trainer_state.pt); point trainer.resume_from_path at a global_step_N directory"
        )
    return torch.load(path / "trainer_state.pt", weights_only=False)
