"""Checkpoints: plain ``save_pretrained`` directories, atomic, pruned, and the only thing resume trusts."""

from __future__ import annotations

import json

import pytest
import torch

from tearless.data import render_prompt
from tearless.rollout.hf import HFRollout, left_pad
from tearless.run import checkpoint as ckpt


def make_checkpoint_dir(run_dir, name, *, complete=True):
    path = run_dir / name
    (path / "actor").mkdir(parents=True)
    (path / "trainer_state.pt").write_bytes(b"")
    if complete:
        (path / ckpt.MARKER).write_text("x")
    return path


def test_latest_checkpoint_skips_temporary_and_incomplete_directories(tmp_path):
    make_checkpoint_dir(tmp_path, "global_step_2")
    make_checkpoint_dir(tmp_path, "global_step_10")  # numeric order: 10 is newer than 9
    make_checkpoint_dir(tmp_path, "global_step_9")
    # A crash mid-save leaves a hidden temporary directory, even one holding the marker ...
    make_checkpoint_dir(tmp_path, ".global_step_11.tmp-123")
    # ... or (written by something else) a step directory without the marker.
    make_checkpoint_dir(tmp_path, "global_step_12", complete=False)
    make_checkpoint_dir(tmp_path, "global_step_13x")
    (tmp_path / "global_step_14").write_text("a file, not a directory")
    found = ckpt.complete_checkpoints(tmp_path)
    assert [p.name for p in found] == ["global_step_2", "global_step_9", "global_step_10"]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "global_step_10"


def test_latest_checkpoint_of_an_empty_or_missing_directory_is_none(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None
    assert ckpt.latest_checkpoint(tmp_path / "missing") is None
    make_checkpoint_dir(tmp_path, ".global_step_9.tmp-123")
    make_checkpoint_dir(tmp_path, "global_step_9", complete=False)
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_load_state_refuses_an_incomplete_checkpoint(tmp_path):
    path = make_checkpoint_dir(tmp_path, "global_step_3", complete=False)
    with pytest.raises(FileNotFoundError, match="resume_from_path"):
        ckpt.load_state(path)


@pytest.mark.parametrize("keep", [0, 10, 200])
def test_a_truncated_trainer_state_is_named_with_the_fix_not_torchs_advice(tmp_path, keep):
    path = make_checkpoint_dir(tmp_path, "global_step_3")
    buffer = tmp_path / "state.pt"
    torch.save({"global_step": 3, "config": {}, "rng": list(range(100))}, buffer)
    (path / "trainer_state.pt").write_bytes(buffer.read_bytes()[:keep])
    with pytest.raises(ckpt.CheckpointDamaged) as info:
        ckpt.load_state(path)
    message = str(info.value)
    assert message.startswith(f"{path / 'trainer_state.pt'} is truncated or damaged")
    assert "weights_only" not in message and "resume_from_path" in message


class _Saves:
    """A stand-in with ``save_pretrained`` that writes one file (the layout is what is tested)."""

    def __init__(self, fail=False):
        self.fail = fail

    def save_pretrained(self, path):
        path.mkdir(parents=True, exist_ok=True)
        (path / "weights.bin").write_text("w")
        if self.fail:
            raise OSError("disk full")


def test_save_checkpoint_is_atomic_and_prunes_to_keep(tmp_path):
    for step in (1, 2, 3):
        final = ckpt.save_checkpoint(
            tmp_path, step, model=_Saves(), tokenizer=_Saves(), state={"global_step": step}, keep=2
        )
        assert final == tmp_path / f"global_step_{step}"
        assert (tmp_path / ckpt.TRACKER).read_text() == str(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step_2",
        "global_step_3",
        ckpt.TRACKER,
    ]
    assert ckpt.load_state(tmp_path / "global_step_3") == {"global_step": 3, "format": {"manifest": 1}}
    # A save that fails halfway leaves nothing behind and the previous checkpoint in charge.
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_checkpoint(tmp_path, 4, model=_Saves(fail=True), tokenizer=_Saves(), state={})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "global_step_3", ckpt.TRACKER]
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "global_step_3"


@pytest.mark.slow
def test_checkpoint_loads_with_transformers_alone_and_generates_like_the_trainer(trained_run, task):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir = trained_run
    actor_dir = run_dir / "global_step_12" / "actor"
    model = AutoModelForCausalLM.from_pretrained(actor_dir)
    tok = AutoTokenizer.from_pretrained(actor_dir)
    assert tok.pad_token_id != tok.eos_token_id
    # The checkpoint is the trained policy, not the starting model.
    start = AutoModelForCausalLM.from_pretrained(task.model_dir)
    assert any(not a.equal(b) for a, b in zip(model.parameters(), start.parameters(), strict=True))

    questions = ["7+8=", "47+38=", "0+0=", "99+99=", "15+6=", "62+29="]
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) == 3  # different lengths, so left padding matters
    ours = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id).generate(
        prompts, max_new_tokens=16, do_sample=False
    )
    ids, mask = left_pad(prompts, tok.pad_token_id)
    theirs = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )[:, ids.shape[1] :]
    for i in range(len(prompts)):
        length = int(ours.response_mask[i].sum())
        assert theirs[i, :length].tolist() == ours.response_ids[i, :length].tolist(), questions[i]
        assert (theirs[i, length:] == tok.pad_token_id).all()
    answers = [
        tok.decode(r[m.bool()], skip_special_tokens=True)
        for r, m in zip(ours.response_ids, ours.response_mask, strict=True)
    ]
    # The response format the warm-up taught survives RL: "<units sum>, <answer>".
    assert all("," in a for a in answers), answers


@pytest.mark.slow
def test_max_actor_ckpt_to_keep_prunes_and_resume_modes(overrides, tmp_path):
    from tearless import train
    from tearless.run.tracking import read_metrics

    run = tmp_path / "run"
    args = overrides(
        run,
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2",
        "trainer.val_before_train=false",
        "data.val_max_samples=8",
    )
    train(None, args, log=lambda _: None)
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert (run / ckpt.TRACKER).read_text() == "3"
    state = ckpt.load_state(run / "global_step_3")
    assert state["global_step"] == 3 and state["config"]["trainer"]["max_actor_ckpt_to_keep"] == 2

    # Debris of crashed saves is never resumed from: auto picks global_step_3, which is complete.
    make_checkpoint_dir(run, ".global_step_9.tmp-123")
    make_checkpoint_dir(run, "global_step_8", complete=False)
    summary = train(None, args, log=lambda _: None)
    assert summary["start_step"] == 3 and "after" not in summary

    # resume_path starts from the named checkpoint, even when a newer one exists ...
    summary = train(
        None,
        [*args, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={run / 'global_step_2'}"],
        log=lambda _: None,
    )
    assert summary["start_step"] == 2
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    # ... disable refuses a directory that holds another run's checkpoints (mixing the two would let a
    # later resume or the pruning pick the wrong ones) and leaves it untouched ...
    with pytest.raises(FileExistsError, match=r"resume_mode=disable.*global_step_3"):
        train(None, [*args, "trainer.resume_mode=disable"], log=lambda _: None)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    # ... and in a fresh directory starts from the base model.
    fresh = [
        a if not a.startswith("trainer.default_local_dir=") else f"trainer.default_local_dir={tmp_path / 'b'}"
        for a in args
    ]
    summary = train(None, [*fresh, "trainer.resume_mode=disable"], log=lambda _: None)
    assert summary["start_step"] == 0
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3]
    # A resume path that is not a checkpoint fails clearly.
    with pytest.raises(FileNotFoundError, match="not a complete tearless checkpoint"):
        train(
            None,
            [*args, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={run}"],
            log=lambda _: None,
        )


@pytest.mark.slow
def test_val_only_on_a_trained_run_validates_its_latest_checkpoint(trained_run, task, tmp_path):
    # `trainer.val_only=true` "validates and stops": pointed at a run directory with checkpoints it
    # resumes the latest one, so its validation must be the trained run's final validation exactly
    # (greedy and the seeded sampled pass alike).
    import shutil

    from tearless import train

    summary, run_dir = trained_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    config = ckpt.load_state(copy / "global_step_12")["config"]
    assert config["trainer"]["default_local_dir"] == str(run_dir)
    result = train(
        config,
        [f"trainer.default_local_dir={copy}", "trainer.val_only=true", "trainer.logger=[jsonl]"],
        log=lambda _: None,
    )
    assert result["start_step"] == 12
    assert result.get("before") == summary["after"]


def _two_checkpoints(run_dir):
    """Steps 1 and 2 written by :func:`ckpt.save_checkpoint`, with a config in their state as the RL
    trainer's have (a manifest-era checkpoint) and 4 kB of 'weights'."""

    def write(directory):
        (directory / "actor").mkdir()
        (directory / "actor" / "model.safetensors").write_bytes(bytes(range(256)) * 16)

    for step in (1, 2):
        ckpt.save_checkpoint(run_dir, step, state={"global_step": step, "config": {"a": 1}}, write=write)
    return run_dir / "global_step_2"


def _flip_a_bit(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("downgrade", ["deleted", "empty", "unlisted"])
def test_a_manifest_cannot_be_downgraded_away(tmp_path, downgrade):
    """Issue 33, item 7: deleting the manifest of a checkpoint written with one (or emptying its file
    list, or dropping a file from it) loaded a flipped weight bit after at most a warning. A
    checkpoint written by a manifest-era version needs its manifest, listing every file."""
    newest = _two_checkpoints(tmp_path)
    _flip_a_bit(newest / "actor" / "model.safetensors")
    manifest = newest / "MANIFEST.json"
    if downgrade == "deleted":
        manifest.unlink()
    else:
        data = json.loads(manifest.read_text())
        if downgrade == "empty":
            data["files"] = {}
        else:
            del data["files"]["actor/model.safetensors"]
        manifest.write_text(json.dumps(data))
    logs: list[str] = []
    assert ckpt.checkpoint_to_resume(tmp_path, log=logs.append) == tmp_path / "global_step_1"
    (damaged,) = [line for line in logs if "global_step_2 is damaged" in line]
    assert {
        "deleted": "MANIFEST.json is missing, though this checkpoint was written by a tearless that writes",
        "empty": "MANIFEST.json lists no files",
        "unlisted": "actor/model.safetensors is not in MANIFEST.json",
    }[downgrade] in damaged
    with pytest.raises(ckpt.CheckpointDamaged, match="resume_from_path"):
        ckpt.checkpoint_to_resume(tmp_path, newest, log=logs.append)


def test_a_checkpoint_from_before_manifests_still_resumes_with_a_warning(tmp_path):
    newest = _two_checkpoints(tmp_path)
    (newest / "MANIFEST.json").unlink()
    torch.save({"global_step": 2}, newest / "trainer_state.pt")  # no config, no format: pre-manifest
    logs: list[str] = []
    assert ckpt.checkpoint_to_resume(tmp_path, log=logs.append) == newest
    assert any("has no MANIFEST.json (written before checksums)" in line for line in logs)
