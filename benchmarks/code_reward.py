"""Throughput of the code execution reward: sandboxed samples scored per second on this machine.

A batch mixes what a code RL run sees: correct, wrong and crashing standard-input programs and
LeetCode-style function solutions, each against ``--tests`` test cases. The batch goes through the
reward manager's process pool (``prime``, ``--workers`` processes), as in training; every sample
starts its own sandbox and every test its own process. Programs that time out are left out: each
costs its time limit, whatever the machine. Prints the median over ``--repeats``.

    OMP_NUM_THREADS=1 python benchmarks/code_reward.py --samples 64 --tests 10 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from tearless.rewards import RewardManager

FENCE = "```"
STDIO = {
    "right": "n = int(input())\nnums = list(map(int, input().split()))\nprint(sum(nums))",
    "wrong": "n = int(input())\nnums = list(map(int, input().split()))\nprint(sum(nums) + 1)",
    "crash": "n = int(input())\nprint(undefined_name)",
}
CALL = (
    "class Solution:\n"
    "    def maxProfit(self, prices):\n"
    "        best, low = 0, float('inf')\n"
    "        for p in prices:\n"
    "            low = min(low, p)\n"
    "            best = max(best, p - low)\n"
    "        return best\n"
)


def samples(count: int, tests: int) -> list[dict]:
    """``count`` scoring requests cycling through the four kinds of program."""
    stdio_truth = json.dumps(
        {
            "inputs": [
                f"{i + 3}\n" + " ".join(str(j * i % 97) for j in range(i + 3)) + "\n" for i in range(tests)
            ],
            "outputs": [f"{sum(j * i % 97 for j in range(i + 3))}\n" for i in range(tests)],
        }
    )
    prices = [[(7 * j + i) % 11 for j in range(i + 5)] for i in range(tests)]
    best = [max(max(p[b] - min(p[: b + 1]) for b in range(len(p))), 0) for p in prices]
    call_truth = json.dumps(
        {"fn_name": "maxProfit", "inputs": [[p] for p in prices], "outputs": [[b] for b in best]}
    )
    kinds = [(STDIO["right"], stdio_truth), (STDIO["wrong"], stdio_truth), (STDIO["crash"], stdio_truth),
             (CALL, call_truth)]  # fmt: skip
    return [
        {
            "data_source": "code",
            "solution_str": f"Here is the program.\n{FENCE}python\n{code}\n{FENCE}",
            "ground_truth": truth,
            "extra_info": {},
        }
        for code, truth in (kinds[i % len(kinds)] for i in range(count))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--tests", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    batch = samples(args.samples, args.tests)
    rates = []
    with RewardManager(num_workers=args.workers, timeout_s=60.0) as manager:
        manager.score(batch[:2])  # fork the workers before timing
        for _ in range(args.repeats):
            start = time.perf_counter()
            results = manager.score(batch)
            rates.append(len(batch) / (time.perf_counter() - start))
    scores = [r.score for r in results]
    assert all(r.error is None for r in results), [r.error for r in results if r.error][:3]
    assert scores[:4] == [1.0, 0.0, 0.0, 1.0], scores[:4]
    rate = statistics.median(rates)
    print(
        f"code reward: {rate:.1f} samples/s ({rate * args.tests:.0f} tests/s) with {args.workers} workers, "
        f"{args.tests} tests per sample, median of {args.repeats}; {os.cpu_count()} CPUs, "
        f"{platform.python_version()}, root={os.geteuid() == 0}"
    )


if __name__ == "__main__":
    main()
