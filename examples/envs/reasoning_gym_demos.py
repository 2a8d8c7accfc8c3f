"""Demonstrations for a supervised warm-up on reasoning-gym's two-term additions.

The embedded model was warmed up on ``47+38=`` and answers reasoning-gym's ``Calculate 47 + 38.``
with nothing right (greedy 0.0 on 200 held-out questions), which leaves GRPO no signal. This writes
SFT rows (prompt + response) for the questions of a ``train.parquet`` that
``tearless data make reasoning_gym:basic_arithmetic`` wrote, answered by the embedded task's flawed
teacher (it drops 70% of the units carries), the answer in reasoning-gym's ``<answer>…</answer>``,
so that RL starts from a model that is right sometimes.

    python examples/envs/reasoning_gym_demos.py data/rg/train.parquet data/rg/sft.jsonl
"""

from __future__ import annotations

import json
import random
import re
import sys

import pyarrow.parquet as pq

from tearless.tasks.arithmetic import flawed_teacher


def main(train_parquet: str, out_jsonl: str, num: int = 8000, seed: int = 0) -> None:
    rows = pq.read_table(train_parquet).to_pylist()
    rng = random.Random(seed)
    with open(out_jsonl, "w") as f:
        for _ in range(num):
            row = rng.choice(rows)
            a, b = (int(x) for x in re.findall(r"\d+", row["prompt"][0]["content"])[:2])
            work, _, answer = flawed_teacher(a, b, rng, 0.7).rpartition(", ")
            response = f"{work}, <answer>{answer}</answer>"  # reasoning-gym's answer convention
            f.write(json.dumps({"prompt": row["prompt"], "response": response}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
