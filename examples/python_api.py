# %% [markdown]
# # GRPO from Python: your own rows, your own reward
#
# A notebook-style script (each `# %%` is a cell in Jupyter or VS Code; `python examples/python_api.py`
# runs it all). It trains the embedded tiny model with tearless's Python API on a dataset made here,
# scored by a reward function written here, and prints held-out accuracy before and after.
#
# The model is the one `tearless train` builds on first use: a 0.44 M-parameter Llama warmed up on a
# *flawed teacher* that drops the carry of the units column 70% of the time. So the dataset below is
# carry problems only, the ones it gets wrong.

# %%
import os
import random
import re
import time

from transformers import AutoModelForCausalLM, AutoTokenizer

import tearless

# The embedded task's model directory (built and cached on the first call, about 25 s on 2 cores).
# TEARLESS_EXAMPLE_MODEL points at an existing one instead (the test suite passes its own).
model_dir = os.environ.get("TEARLESS_EXAMPLE_MODEL")
if model_dir is None:
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    model_dir = prepare_task(TaskSpec()).model_dir
model = AutoModelForCausalLM.from_pretrained(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)


# %% [markdown]
# ## A custom dataset: rows as plain dicts
#
# A row needs a `prompt` (chat messages here, because this model was trained with its chat template)
# and a `ground_truth`; its other columns (`a`, `b`) reach the reward function in `extra_info`. A
# `datasets.Dataset` with these columns works the same.


# %%
def carry_problems(num: int, seed: int) -> list[dict]:
    """Two-digit additions whose units column carries (7+8=15): the teacher's weak spot."""
    rng = random.Random(seed)
    rows: list[dict] = []
    while len(rows) < num:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        if a % 10 + b % 10 >= 10:
            prompt = [{"role": "user", "content": f"{a}+{b}="}]
            rows.append({"prompt": prompt, "ground_truth": a + b, "a": a, "b": b})
    return rows


train_rows, test_rows = carry_problems(512, seed=0), carry_problems(64, seed=1)
print(train_rows[0])


# %% [markdown]
# ## A custom reward: veRL's signature
#
# `(data_source, solution_str, ground_truth, extra_info=None) -> float`. The model answers like
# `7+8=15, 85` (units column, then the sum): full marks for the right final number.


# %%
def final_sum_correct(data_source, solution_str, ground_truth, extra_info=None):
    match = re.search(r"(-?\d+)\s*$", solution_str)
    return 1.0 if match and int(match.group(1)) == int(ground_truth) else 0.0


# %% [markdown]
# ## The config: typed objects with the YAML's fields
#
# `tearless.RLConfig` is the schema behind `tearless config show`: `config.data.train_batch_size` is
# `data.train_batch_size=...` on the command line.

# %%
steps = int(os.environ.get("TEARLESS_EXAMPLE_STEPS", "12"))
config = tearless.RLConfig(
    data=tearless.DataConfig(train_batch_size=32, max_response_length=16),
    actor_rollout_ref=tearless.ActorRolloutRefConfig(
        actor=tearless.ActorConfig(ppo_mini_batch_size=32), rollout=tearless.RolloutConfig(n=8)
    ),
    # The reward is a cheap regex: score it in this process rather than in reward worker processes.
    reward_model=tearless.RewardModelConfig(num_workers=0),
    trainer=tearless.TrainerConfig(
        total_training_steps=steps,
        # A new directory per run: the same directory again would resume the finished run.
        default_local_dir=f"runs/python-api-example/{time.strftime('%Y%m%d-%H%M%S')}",
        seed=2,
    ),
)

# %% [markdown]
# ## Train
#
# A callback receives each step's metrics (the names of `metrics.jsonl`); the progress bar is
# `tqdm.auto`, a widget in a notebook.

# %%
rewards: list[float] = []


def keep_reward(step: int, metrics: dict) -> None:
    if "critic/score/mean" in metrics:
        rewards.append(metrics["critic/score/mean"])


trainer = tearless.Trainer(
    model=model,
    reward_funcs=final_sum_correct,
    args=config,
    train_dataset=train_rows,
    eval_dataset=test_rows,
    processing_class=tokenizer,
    callbacks=[keep_reward],
)
summary = trainer.train()

# %%
before = summary["before"]["val-core/custom/acc/greedy"]
after = summary["after"]["val-core/custom/acc/greedy"]
print(f"training reward by step: {' '.join(f'{r:.2f}' for r in rewards)}")
print(f"held-out greedy accuracy on carry problems: before {before:.3f}  after {after:.3f}")
print(f"run directory: {summary['run_dir']}")
