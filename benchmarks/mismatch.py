"""The rollout engine's log-probs against the trainer's, per engine (issue 43, item 6): ``rollout_corr/*``.

Each run is a short GRPO run through :func:`tearless.train` whose update needs π_old from the trainer
(two mini-batches per step, so π_old is recomputed for every engine), and the metrics compare it with
the engine's own log-probs of the sampled tokens, Δ_t = log π_old(y_t) − log π_rollout(y_t):
``rollout_corr/k3_kl`` = mean_t(e^Δ − 1 − Δ) and ``rollout_corr/max_abs_log_ratio`` = max_t |Δ_t|.
Printed per step and as the median k3 and the largest |Δ| over the steps, with the bound the
built-in engine's tests hold it to in float32 (``tests/tolerances.logprob_tol``).

    OMP_NUM_THREADS=1 python benchmarks/mismatch.py --case small --engine hf
    OMP_NUM_THREADS=1 python benchmarks/mismatch.py --case smollm2-L64 --engine hf --dtype bfloat16
    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=$PWD $VENV/bin/python benchmarks/mismatch.py --engine vllm

``--case``: ``small`` (the embedded task's tiny Llama) or ``smollm2-L<length>`` (the real model,
``benchmarks/cases.py``). ``--dtype bfloat16`` runs the built-in engine and the trainer's forward under
bf16 autocast (a CPU with native bf16, or a GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import make_case, short_run


def run(case_name: str, engine: str, dtype: str, steps: int, seed: int) -> dict:
    from transformers import AutoConfig

    from tests.tolerances import logprob_tol

    case = make_case(case_name)
    rows = short_run(
        case,
        steps,
        # two mini-batches: the second is off-policy, so π_old is the trainer's forward
        f"actor_rollout_ref.actor.ppo_mini_batch_size={max(1, case.prompts_per_step // 2)}",
        f"actor_rollout_ref.actor.optim.lr={case.lr}",
        f"actor_rollout_ref.rollout.name={engine}",
        f"actor_rollout_ref.actor.fsdp_config.param_dtype={dtype}",
        f"trainer.seed={seed}",
    )
    rows = [r for r in rows if "rollout_corr/k3_kl" in r]
    return {
        "case": case_name,
        "engine": engine,
        "dtype": dtype,
        "steps": len(rows),
        "k3_per_step": [r["rollout_corr/k3_kl"] for r in rows],
        "max_abs_per_step": [r["rollout_corr/max_abs_log_ratio"] for r in rows],
        "k3_median": statistics.median(r["rollout_corr/k3_kl"] for r in rows),
        "max_abs": max(r["rollout_corr/max_abs_log_ratio"] for r in rows),
        "float32_bound": logprob_tol(AutoConfig.from_pretrained(case.model_dir)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="small")
    parser.add_argument("--engine", default="hf", help="hf (built-in) or vllm")
    parser.add_argument("--dtype", default="null", help="fsdp_config.param_dtype: null (float32) or bfloat16")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(run(args.case, args.engine, args.dtype, args.steps, args.seed)))


if __name__ == "__main__":
    main()
