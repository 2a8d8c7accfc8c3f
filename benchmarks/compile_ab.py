"""``use_torch_compile`` against eager on a CPU: whole short runs of a case, variants alternated.

Each run is a fresh process (``cases.short_run``) with an empty inductor cache of its own, so the
compile time a new user pays is in its wall time. Variants:

- ``eager``: the CPU defaults (the shared-prompt padded pass; its calls carry a KV cache, so
  ``use_torch_compile`` would change nothing there);
- ``packed``: ``model.use_remove_padding=true``, eager (the GPU's default pass);
- ``compiled``: ``use_remove_padding=true`` and ``actor.use_torch_compile=true`` (every layer of the
  update and of the log-prob pass compiled).

Printed per run: wall seconds, the mean ``timing_s/update_actor`` and ``timing_s/old_log_prob`` of the
steps after the first (the first holds the compiles), and the first step's; then medians per variant
and the ratios to ``eager``.

    OMP_NUM_THREADS=1 python benchmarks/compile_ab.py --case smollm2-L64 --steps 4 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "eager": [],
    "packed": ["actor_rollout_ref.model.use_remove_padding=true"],
    "compiled": [
        "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_torch_compile=true",
    ],
}
PHASES = ("timing_s/update_actor", "timing_s/old_log_prob")


def one_run(case: str, steps: int, variant: str) -> dict:
    """The numbers of one fresh-process run of ``variant``."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]);"
        "from cases import make_case, short_run;"
        "case = make_case(sys.argv[2]);"
        "mini = f'actor_rollout_ref.actor.ppo_mini_batch_size={case.prompts_per_step}';"
        "rows = short_run(case, int(sys.argv[3]), mini, *json.loads(sys.argv[4]));"
        "print('ROWS ' + json.dumps(rows))"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        here = str(Path(__file__).resolve().parent)
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", code, here, case, str(steps), json.dumps(VARIANTS[variant])],
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        wall = time.perf_counter() - start
    rows = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ROWS "))[5:])
    steady = {p: statistics.mean(r.get(p, 0.0) for r in rows[1:]) for p in PHASES}
    first = {p: rows[0].get(p, 0.0) for p in PHASES}
    return {"variant": variant, "wall_s": round(wall, 1), "steady": steady, "first": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="smollm2-L64")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--variants", default="eager,packed,compiled")
    args = ap.parse_args()
    names = args.variants.split(",")
    runs: list[dict] = []
    for i in range(args.pairs):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            run = one_run(args.case, args.steps, name)
            runs.append(run)
            print(json.dumps(run), flush=True)
    summary = {}
    for name in names:
        mine = [r for r in runs if r["variant"] == name]
        summary[name] = {
            "wall_s": statistics.median(r["wall_s"] for r in mine),
            **{f"steady {p}": round(statistics.median(r["steady"][p] for r in mine), 3) for p in PHASES},
            **{f"first {p}": round(statistics.median(r["first"][p] for r in mine), 3) for p in PHASES},
        }
    base = summary[names[0]]
    for name in names:
        ratios = {k: round(v / base[k], 3) for k, v in summary[name].items() if base[k]}
        print(f"{name}: {json.dumps(summary[name])}\n  / {names[0]}: {json.dumps(ratios)}")


if __name__ == "__main__":
    main()
