"""Hugging Face Hub model IDs: ``org/name`` (optionally ``org/name@revision``) resolved to a local
snapshot directory through ``huggingface_hub``, downloaded and cached as every peer does.

A model or tokenizer key (``actor_rollout_ref.model.path``, ``critic.model.path``,
``reward_model.model.path``, the PRM's, SFT/DPO/KTO's ``model.path``, ``tearless eval``'s model) takes
a local directory or a Hub ID. A path that exists on disk is always the local directory; otherwise a
string of the form ``org/name[@revision]`` is looked up in the Hub cache (``HF_HUB_CACHE``, else
``HF_HOME/hub``, else ``~/.cache/huggingface/hub``) and downloaded when missing. With
``HF_HUB_OFFLINE=1`` nothing is downloaded: a cached snapshot is used, and a model that is not cached
fails in one line that names the key. ``revision`` is a branch, tag or commit hash (default ``main``).

Only what transformers loads is fetched (configs, safetensors weights, tokenizer files, chat
templates), not a repository's other formats (GGUF, ONNX, ``pytorch_model.bin`` duplicates).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from tearless.userfiles import check_model_files

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_TRUE = {"1", "on", "yes", "true"}


class HubError(FileNotFoundError):
    """A Hub ID that cannot be resolved; the message names the key, the ID and the fix."""


def is_hub_id(path: str | os.PathLike) -> bool:
    """Whether ``path`` reads as ``org/name[@revision]`` and is not a path that exists on disk."""
    text = str(path)
    return not os.path.exists(os.path.expanduser(text)) and bool(_HUB_ID.match(text))


def split_revision(hub_id: str) -> tuple[str, str | None]:
    """``org/name@rev`` → (``org/name``, ``rev``); no ``@`` → (the ID, None)."""
    repo, _, revision = hub_id.partition("@")
    return repo, revision or None


def hub_cache_dir() -> Path:
    """The cache huggingface_hub uses, read from the environment at call time (not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or transformers' ``TRANSFORMERS_OFFLINE``) is set to a true value."""
    return any(
        os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def resolve_hub_model(hub_id: str, key: str) -> Path:
    """The local snapshot directory of ``hub_id`` (``org/name[@revision]``), downloading it unless
    offline. Raises :class:`HubError` with one line naming ``key`` when it cannot be had."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise HubError(
            f"{key}={hub_id}: a Hub model ID needs the huggingface_hub package (pip install "
            "huggingface_hub), or give a local model directory"
        ) from None
    repo, revision = split_revision(hub_id)
    cache, offline = hub_cache_dir(), hub_offline()
    try:
        return Path(
            snapshot_download(
                repo,
                revision=revision,
                cache_dir=cache,
                local_files_only=offline,
                allow_patterns=ALLOW_PATTERNS,
            )
        )
    except (RevisionNotFoundError, GatedRepoError, RepositoryNotFoundError) as err:
        what = {
            RevisionNotFoundError: f"the Hub repository has no revision {revision!r}",
            GatedRepoError: "the Hub repository is gated: accept its licence and log in (hf auth login)",
            RepositoryNotFoundError: "no such model on the Hugging Face Hub (or it is private: log in)",
        }[type(err)]
        raise HubError(f"{key}={hub_id}: not a local directory, and {what}") from None
    except LocalEntryNotFoundError:
        rev = f" at revision {revision!r}" if revision else ""
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub could not be reached"
        raise HubError(
            f"{key}={hub_id}: not a local directory, and not in the Hugging Face cache ({cache}){rev} while "
            f"{why}; download it once online (hf download {repo}), or give a local model directory"
        ) from None
    except (HfHubHTTPError, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise HubError(
            f"{key}={hub_id}: not a local directory, and the download from the Hugging Face Hub failed "
            f"({first}); retry, or give a local model directory"
        ) from None


def add_to_hub_cache(
    model_dir: str | os.PathLike,
    hub_id: str,
    *,
    commit: str = "0" * 40,
    cache_dir: str | os.PathLike | None = None,
) -> Path:
    """Copy ``model_dir`` into the Hub cache as ``hub_id`` (``org/name[@ref]``, ref default ``main``)
    at ``commit``, in the layout huggingface_hub writes: ``models--org--name/refs/<ref>`` holding the
    commit hash, and ``snapshots/<commit>/`` holding the files. Returns the snapshot directory.

    For machines without network that are handed a model directory (and for tests and the
    real-model benchmark): afterwards ``hub_id`` resolves offline, as if downloaded. The files are
    the given directory's, whatever the Hub holds under that name.
    """
    repo, ref = split_revision(hub_id)
    if not _HUB_ID.match(repo) or not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise ValueError(
            f"add_to_hub_cache: {hub_id!r} is not org/name[@ref] or {commit!r} not a 40-hex commit"
        )
    root = Path(cache_dir).expanduser() if cache_dir is not None else hub_cache_dir()
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for item in Path(model_dir).iterdir():
        if item.is_file():
            shutil.copy2(item, snapshot / item.name)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / (ref or "main")).write_text(commit)
    return snapshot


def local_model_path(path: str, key: str) -> str:
    """``path`` itself, or the snapshot directory of the Hub ID it names (see :func:`resolve_hub_model`),
    once its files passed :func:`tearless.userfiles.check_model_files` (regular files of sane size)."""
    local = str(resolve_hub_model(path, key)) if is_hub_id(path) else path
    check_model_files(local, key=key)
    return local
