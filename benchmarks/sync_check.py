"""The cost of checking each vLLM weight sync (issue 43, item 3): the sync probe alone against the probe
plus the weight checksum.

Alternated runs of ``--steps`` GRPO steps on the real model (``smollm2-L64``, ``benchmarks/cases.py``)
through the vLLM engine, one with ``rollout.weight_checksum=true`` and one with ``false`` per round;
per step, ``timing_s/sync_check`` (the probe, and the checksum where on) and the step's seconds, medians
over the steps and rounds. The share of a step is ``sync_check / step``.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 PYTHONPATH=$PWD $VENV/bin/python \\
        benchmarks/sync_check.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cases import vllm_run


def run(case_name: str, checksum: bool, steps: int) -> dict[str, list[float]]:
    rows = vllm_run(case_name, steps, f"actor_rollout_ref.rollout.weight_checksum={str(checksum).lower()}")
    return {
        "sync_check_s": [r["timing_s/sync_check"] for r in rows],
        "step_s": [r["timing_s/step"] for r in rows],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default="smollm2-L64")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {"probe+checksum": {}, "probe": {}}
    for i in range(args.rounds):
        for checksum in (True, False) if i % 2 == 0 else (False, True):
            name = "probe+checksum" if checksum else "probe"
            for k, v in run(args.case, checksum, args.steps).items():
                results[name].setdefault(k, []).extend(v)
    median = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    for m in median.values():
        m["share_of_step"] = m["sync_check_s"] / m["step_s"]
    checksum_s = median["probe+checksum"]["sync_check_s"] - median["probe"]["sync_check_s"]
    print(json.dumps({"case": args.case, "raw": results, "median": median, "checksum_s": checksum_s}))


if __name__ == "__main__":
    main()
