"""Write failures while saving a checkpoint, injected where a test cannot make the kernel fail.

The process runs as root here, so permission bits do not stop its writes, and a full disk cannot be
made on demand: ``OSError(ENOSPC)`` / ``OSError(EACCES)`` is raised at the write calls themselves
(the real EFBIG case, through RLIMIT_FSIZE, is in ``test_kills.py``). Every case must end with a
:class:`CheckpointError` that says what failed and which checkpoint is still the latest, the
previous checkpoint untouched and nothing of the new one left behind.
"""

from __future__ import annotations

import errno
import os

import pytest
from safetensors.torch import load_file

from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.run import checkpoint as ckpt


@pytest.fixture(scope="module")
def parts(task):
    return load_causal_lm(task.model_dir), load_tokenizer(task.model_dir)


def _save(run_dir, step, parts):
    model, tok = parts
    return ckpt.save_checkpoint(run_dir, step, model=model, tokenizer=tok, state={"global_step": step})


def _snapshot(path):
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _fail_with(code):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize(
    ("where", "code", "hint"),
    [
        ("torch.save", errno.ENOSPC, "free disk space"),
        ("safetensors", errno.ENOSPC, "free disk space"),
        ("rename", errno.EACCES, "make trainer.default_local_dir writable"),
        ("torch.save", errno.EDQUOT, "quota"),
        ("safetensors", errno.EROFS, "read-only"),
    ],
)
def test_a_failed_save_is_clear_and_leaves_the_previous_checkpoint_alone(
    parts, tmp_path, monkeypatch, where, code, hint
):
    first = _save(tmp_path, 1, parts)
    before = _snapshot(first)
    if where == "torch.save":
        monkeypatch.setattr(ckpt.torch, "save", _fail_with(code))
    elif where == "safetensors":
        # transformers writes the weights with safetensors' save_file; its Rust writer reports an
        # OS error as "(os error N)" in a SafetensorError, not as an OSError.
        import transformers.modeling_utils as mu
        from safetensors import SafetensorError

        def fail(*args, **kwargs):
            raise SafetensorError(
                f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})"
            )

        monkeypatch.setattr(mu, "safe_save_file", fail)
    else:
        real = os.replace

        def replace(src, dst):
            if "global_step_2" in str(dst):
                raise OSError(code, os.strerror(code))
            return real(src, dst)

        monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(ckpt.CheckpointError) as info:
        _save(tmp_path, 2, parts)
    message = str(info.value)
    assert info.value.errno == code
    assert (
        f"saving checkpoint global_step_2 in {tmp_path} failed ([Errno {code}] {os.strerror(code)}" in message
    )
    assert f"the latest complete checkpoint is still {first}" in message and hint in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", ckpt.TRACKER]
    assert _snapshot(first) == before and (tmp_path / ckpt.TRACKER).read_text() == "1"
    monkeypatch.undo()
    # Once the disk has room again, the next save works and loads.
    second = _save(tmp_path, 2, parts)
    assert ckpt.load_state(second)["global_step"] == 2 and load_file(second / "actor" / "model.safetensors")


def test_a_failed_pointer_update_keeps_the_new_checkpoint_and_says_so(parts, tmp_path, monkeypatch):
    _save(tmp_path, 1, parts)
    real = ckpt._atomic_write_text

    def full(path, text):
        real(path.with_name("probe"), text)  # the real helper, then the disk "fills up"
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "_atomic_write_text", full)
    with pytest.raises(ckpt.CheckpointError, match=r"global_step_2 was saved, but updating .* failed"):
        _save(tmp_path, 2, parts)
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "global_step_2"


def test_a_failure_that_is_not_the_disk_is_raised_as_it_is(parts, tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        _save(tmp_path, 1, parts)
    assert os.listdir(tmp_path) == []


def test_os_errno_finds_the_error_behind_wrappers():
    try:
        try:
            raise OSError(errno.EFBIG, "File too large")
        except OSError:
            # Implicit chaining (__context__), as torch's writer leaves it.
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")  # noqa: B904
    except RuntimeError as wrapped:
        assert ckpt.os_errno(wrapped) == errno.EFBIG
    assert ckpt.os_errno(Exception("I/O error: No space left on device (os error 28)")) == errno.ENOSPC
    assert ckpt.os_errno(ValueError("no")) is None
