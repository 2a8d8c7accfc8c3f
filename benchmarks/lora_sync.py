"""LoRA through vLLM: the adapter alone against the merged weights at every sync (issue 43, item 2).

Alternated runs of ``--steps`` GRPO steps on the real model (``smollm2-L64``, ``benchmarks/cases.py``)
through the vLLM engine with ``model.lora_rank=r``, one with ``rollout.lora_sync=adapter`` and one with
``merged`` per round; per sync, the bytes given to the engine (``rollout/engine_sync_mb``) and the
seconds the load took (``timing_s/engine_load_weights``: writing the adapter and registering it, or
streaming every merged tensor into vLLM's reload), medians over the steps and rounds. The sync probe
checks every load in both.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 PYTHONPATH=$PWD $VENV/bin/python \\
        benchmarks/lora_sync.py --rounds 2

Also printed: both sizes projected for a 7B Llama-style model (hidden 4096, MLP 11008, 32 layers,
vocabulary 32000) in bf16 with the same rank on every linear projection.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import vllm_run


def run(case_name: str, sync: str, rank: int, steps: int) -> dict[str, list[float]]:
    rows = vllm_run(
        case_name,
        steps,
        f"actor_rollout_ref.model.lora_rank={rank}",
        f"actor_rollout_ref.model.lora_alpha={2 * rank}",
        f"actor_rollout_ref.rollout.lora_sync={sync}",
    )
    return {
        "mb": [r["rollout/engine_sync_mb"] for r in rows],
        "seconds": [r["timing_s/engine_load_weights"] for r in rows],
        "step_s": [r["timing_s/step"] for r in rows if "timing_s/step" in r],
    }


def projected_7b(rank: int) -> tuple[float, float]:
    """(merged, adapter) bytes for a 7B Llama-style model in bf16 with LoRA on every projection."""
    hidden, mlp, layers, vocab = 4096, 11008, 32, 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * mlp
    merged = 2 * (layers * per_layer + 2 * vocab * hidden)
    adapter = 2 * rank * layers * (4 * (hidden + hidden) + 2 * (hidden + mlp) + (mlp + hidden))
    return merged, adapter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="smollm2-L64")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {"adapter": {}, "merged": {}}
    for i in range(args.rounds):
        for sync in ("adapter", "merged") if i % 2 == 0 else ("merged", "adapter"):
            for k, v in run(args.case, sync, args.rank, args.steps).items():
                results[sync].setdefault(k, []).extend(v)
    merged, adapter = projected_7b(args.rank)
    summary = {sync: {k: statistics.median(v) for k, v in r.items() if v} for sync, r in results.items()}
    summary["projected_7b_bf16_mb"] = {"merged": merged / 2**20, "adapter": adapter / 2**20}
    print(json.dumps({"case": args.case, "rank": args.rank, "raw": results, "median": summary}))


if __name__ == "__main__":
    main()
