"""What a run says about itself: flat groups, bf16 autocast, slow phases; checkpoints it keeps; the
held-out scorer of sft/dpo; continuing a saved LoRA adapter."""

from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

from tearless.config import ConfigError, load_config
from tearless.data.rows import DataError
from tearless.models.precision import cpu_has_native_bf16
from tearless.trainers.progress import Progress
from tearless.trainers.rl import RLTrainer

QUICK = ["trainer.val_before_train=false", "data.val_max_samples=4", "trainer.num_threads=1"]


def test_flat_groups_warn_once_naming_the_fix_and_save_final_checkpoint_false_saves_nothing(
    overrides, tmp_path
):
    """A reward that is always 0 makes every group flat: after the second such step one warning names
    temperature and rollout.n. bf16 autocast is announced where the CPU multiplies bf16 natively."""
    logs: list[str] = []
    cfg = load_config(
        None,
        overrides(
            tmp_path / "run",
            *QUICK,
            "trainer.total_training_steps=3",
            "trainer.save_final_checkpoint=false",
            "actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16",
        ),
    )
    # Without native bf16 the request falls back to float32 with a UserWarning, and nothing is announced.
    with (
        pytest.warns(UserWarning, match="computing in float32")
        if not cpu_has_native_bf16()
        else nullcontext()
    ):
        trainer = RLTrainer(cfg, reward_fn=lambda *a, **k: 0.0, log=logs.append)
    summary = trainer.fit()
    warnings = [line for line in logs if "carry no learning signal" in line]
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: 100% of this step's prompt groups")
    assert "actor_rollout_ref.rollout.temperature (now 1.0)" in warnings[0]
    assert "actor_rollout_ref.rollout.n (now 4)" in warnings[0]
    announced = [line for line in logs if line.startswith("bf16 autocast is on")]
    assert len(announced) == int(cpu_has_native_bf16())
    if announced:
        assert "actor_rollout_ref.actor.fsdp_config.param_dtype" in announced[0]
    assert "checkpoint" not in summary and not list((tmp_path / "run").glob("global_step_*"))


def test_progress_speaks_only_when_a_phase_is_slow():
    lines: list[str] = []
    quick = Progress(lines.append, "validation (greedy)", 64, "prompts", every_s=3600)
    quick.update(32)
    quick.update(64)
    assert lines == []
    slow = Progress(lines.append, "validation (greedy)", 64, "prompts", every_s=0)
    slow.update(32)
    slow.update(64)
    assert [line.rsplit(" (", 1)[0] for line in lines] == [
        "validation (greedy): 32/64 prompts",
        "validation (greedy): 64/64 prompts",
    ]


def test_sft_held_out_scorer_is_checked_before_the_model_loads(tmp_path):
    from tearless.config.sft import SFTConfig
    from tearless.data.rows import write_parquet
    from tearless.trainers.offline import held_out_scorer
    from tearless.trainers.sft import SFTTrainer

    prompts = tmp_path / "prompts.parquet"
    row = {
        "data_source": "my_quiz",
        "prompt": [{"role": "user", "content": "2+2="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "4"},
        "extra_info": {"index": 0},
    }
    write_parquet([row], prompts)
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps({"prompt": "2+2=", "response": "4"}) + "\n")
    base = [f"data.train_files={sft}", f"data.val_prompt_files={prompts}", "model.path=/nonexistent/model"]
    # The unknown data_source is reported, not the missing model: the check runs first.
    with pytest.raises(
        DataError, match=r"data.val_prompt_files: no built-in reward function for data_source 'my_quiz'"
    ):
        SFTTrainer(load_config(None, base, schema=SFTConfig), log=lambda _: None)
    with pytest.raises(ConfigError, match=r"custom_reward_function.path: '.*nope.py' is not a file"):
        load_config(None, [*base, f"custom_reward_function.path={tmp_path / 'nope.py'}"], schema=SFTConfig)
    scorer = tmp_path / "quiz.py"
    scorer.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):\n"
        "    return float(solution_str.strip() == ground_truth) + bonus\n"
    )
    cfg = load_config(
        None,
        [*base, f"custom_reward_function.path={scorer}", "custom_reward_function.name=score",
         "custom_reward_function.reward_kwargs={bonus: 0.5}"],
        schema=SFTConfig,
    )  # fmt: skip
    fn = held_out_scorer(cfg.custom_reward_function, [row])
    assert fn("my_quiz", "4", "4") == 1.5 and fn("my_quiz", "5", "4") == 0.5
    with pytest.raises(FileNotFoundError, match=r"model\.path=/nonexistent/model"):
        SFTTrainer(cfg, log=lambda _: None)  # past the scorer check, the model is what fails


def test_a_saved_lora_adapter_is_continued(overrides, tmp_path):
    """A LoRA run's adapter, given as lora_adapter_path to a new run, is where that run starts: its
    adapter weights before any step equal the saved ones (and B is no longer zero)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    lora = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.optim.lr=2e-3", *QUICK]
    first = tmp_path / "first"
    cfg = load_config(None, overrides(first, *lora, "trainer.total_training_steps=1"))
    RLTrainer(cfg, log=lambda _: None).fit()
    adapter = first / "global_step_1" / "actor"
    saved = load_file(adapter / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in saved.items())
    cont = load_config(
        None, overrides(tmp_path / "second", *lora, f"actor_rollout_ref.model.lora_adapter_path={adapter}")
    )
    model = RLTrainer(cont, log=lambda _: None).workers.rank.roles["actor"].model  # one rank here
    start = get_peft_model_state_dict(model)
    assert start.keys() == saved.keys()
    assert all(torch.equal(start[k], saved[k]) for k in saved)
    wrong = r"the adapter is LORA with rank r=4, not LoRA with .*lora_rank=8\. Set .*lora_rank=4"
    with pytest.raises(ConfigError, match=wrong):
        load_config(
            None,
            overrides(tmp_path / "third", *lora, "actor_rollout_ref.model.lora_rank=8",
                      f"actor_rollout_ref.model.lora_adapter_path={adapter}"),
        )  # fmt: skip
