"""Files named by the user's config, opened only when they are regular files of a sane size.

A path the user gives may lead anywhere: a ``config.json`` that is a symlink to ``/dev/zero`` reads
until the kernel's OOM killer fires, a FIFO blocks the reader forever, a directory or a broken
symlink fails deep inside a library with a message that names neither the key nor the file. Every
place tearless reads (or hands to a library) a file from a user-given path first asks this module,
which refuses anything but a regular file no larger than the cap of its kind, in one line naming the
config key and the file. Nothing here imports torch: the config checks use it before anything heavy.

The caps are far above any real file of the kind and far below the machine's memory where tearless
reads the whole file itself (JSON, templates, code); data and weights, which libraries stream or map,
are capped only against a sparse or runaway file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
# kind → (cap in bytes, what the file is, for the message)
CAPS: dict[str, tuple[int, str]] = {
    "config": (16 * MIB, "config file"),
    "template": (4 * MIB, "chat template"),
    "code": (16 * MIB, "Python file"),
    "tokenizer": (2 * GIB, "tokenizer file"),
    "weights": (4096 * GIB, "weights file"),
    "jsonl": (16 * GIB, "JSON data file"),
    "data": (4096 * GIB, "data file"),
}
# The files of a Hugging Face model directory and the kind each is read as; a name not listed is
# checked by its suffix (:data:`SUFFIX_KINDS`), and anything else only for being a regular file.
MODEL_FILE_KINDS: dict[str, str] = {
    "tokenizer.json": "tokenizer",
    "vocab.json": "tokenizer",
    "merges.txt": "tokenizer",
    "tokenizer.model": "tokenizer",
    "chat_template.jinja": "template",
    "chat_template.json": "template",
}
SUFFIX_KINDS: dict[str, str] = {
    ".json": "config",
    ".jinja": "template",
    ".py": "code",
    ".safetensors": "weights",
    ".bin": "weights",
    ".pt": "weights",
    ".gguf": "weights",
    ".model": "tokenizer",
    ".tiktoken": "tokenizer",
    ".txt": "tokenizer",
}


class UserFileError(ValueError):
    """A user-given file that is not a regular file within its kind's cap; the message names the key."""


def _file_type(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _problem(path: Path, info: os.stat_result, kind: str) -> str | None:
    """Why a file whose (followed) stat is ``info`` may not be read as ``kind``; None when it may."""
    if not stat.S_ISREG(info.st_mode):
        what = _file_type(info.st_mode)
        if path.is_symlink():
            what += f" (it is a symlink to {os.path.realpath(path)})"
        return f"is {what}, not a regular file"
    cap, label = CAPS[kind]
    if info.st_size > cap:
        return f"is {info.st_size:,} bytes, above the {cap:,}-byte cap for a {label}"
    return None


def _refuse(key: str, path: Path, problem: str) -> UserFileError:
    return UserFileError(f"{key}: {path} {problem}; replace it with a regular file or change {key}")


def check_user_file(path: str | os.PathLike, *, key: str, kind: str) -> Path:
    """``path`` as a Path once it is a regular file (symlinks followed) within ``kind``'s cap.

    Only ``stat``: nothing is opened, so a FIFO cannot block and a device cannot be read. Use it
    before handing the path to a library that opens it itself. A path that does not exist raises
    ``FileNotFoundError`` naming the key (a broken symlink says where it points).
    """
    p = Path(path).expanduser()
    try:
        info = os.stat(p)
    except FileNotFoundError:
        if p.is_symlink():
            raise _refuse(key, p, f"is a broken symlink (to {os.readlink(p)})") from None
        raise FileNotFoundError(f"{key}: {p} does not exist") from None
    except OSError as e:
        raise _refuse(key, p, f"cannot be examined ({e.strerror})") from None
    problem = _problem(p, info, kind)
    if problem is not None:
        raise _refuse(key, p, problem)
    return p


def read_user_file(path: str | os.PathLike, *, key: str, kind: str) -> bytes:
    """The bytes of a regular file of at most ``kind``'s cap, else :class:`UserFileError` naming ``key``.

    Checked on the open descriptor (``O_NONBLOCK``: opening a FIFO does not wait for a writer), and
    read to at most cap + 1 bytes, so a file that grows or lies about its size is refused too.
    """
    p = check_user_file(path, key=key, kind=kind)
    cap = CAPS[kind][0]
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        problem = _problem(p, os.fstat(fd), kind)
        if problem is not None:  # swapped between the stat and the open
            raise _refuse(key, p, problem)
        chunks, size = [], 0
        while size <= cap and (chunk := os.read(fd, min(16 * MIB, cap + 1 - size))):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > cap:
        raise _refuse(key, p, f"grew past the {cap:,}-byte cap for a {CAPS[kind][1]} while being read")
    return b"".join(chunks)


def check_model_files(directory: str | os.PathLike, *, key: str) -> None:
    """Check every entry of a model directory that transformers or peft may open (non-recursive).

    Each known file name and each file with a known suffix must be a regular file within its kind's
    cap; any other entry that is not a directory must be a regular file (a FIFO or a device has no
    place in a model directory, and a library that globs the directory might open it).
    """
    d = Path(directory).expanduser()
    try:
        entries = sorted(os.scandir(d), key=lambda e: e.name)
    except OSError:
        return  # not a directory: the caller reports a missing model its own way
    for entry in entries:
        path = Path(entry.path)
        kind = MODEL_FILE_KINDS.get(entry.name) or SUFFIX_KINDS.get(path.suffix.lower())
        if kind is None:
            try:
                if path.is_dir() or stat.S_ISREG(os.stat(path).st_mode):
                    continue
            except FileNotFoundError:
                continue  # a broken link nothing reads by name
            kind = "data"
        check_user_file(path, key=key, kind=kind)
