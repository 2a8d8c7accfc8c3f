"""The CPU settings trainers apply at start: glibc malloc keeps freed memory (no page faults on the
next step's allocations), the user's environment wins, ``keep_memory=False`` leaves malloc alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tearless import cpu

pytestmark = pytest.mark.skipif(cpu.glibc() is None, reason="glibc malloc only (Linux)")

# One step: forward and backward of a tiny HF Llama (the update's allocation pattern: activations
# written in the forward, freed by the backward). The median minor page faults of five steps, after
# three unmeasured ones (the heap settles at the size the step needs), is taken before and after
# configure_cpu().
PROBE = """
import json, resource, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from tearless.cpu import configure_cpu

torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=104, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 104, (64, 12))

def step():
    model(input_ids=ids).logits.logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def faults_per_step():
    for _ in range(3):
        step()
    counts = []
    for _ in range(5):
        start = faults()
        step()
        counts.append(faults() - start)
    return sorted(counts)[2]

before = faults_per_step()
configure_cpu(int(sys.argv[1]), sys.argv[2] == "keep")
print(json.dumps({"before": before, "after": faults_per_step(), "threads": torch.get_num_threads()}))
"""


def probe(threads: int, keep: bool) -> dict:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(threads), "keep" if keep else "off"],
        capture_output=True,
        text=True,
        env=run_env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_memory_is_reused_without_page_faults() -> None:
    # Faults the process did not cause only ever add to a count, so of up to three probes the one with
    # the lowest 'after' is the one least disturbed (one probe in a full-suite run of 2026-11-28 gave
    # before 257, after 384; alone it passes).
    runs = []
    for _ in range(3):
        runs.append(probe(threads=1, keep=True))
        if runs[-1]["after"] <= runs[-1]["before"] / 5:
            break
    got = min(runs, key=lambda r: r["after"])
    # glibc's default gives the heap's free top back after a backward and faults it in again at the
    # next forward (1,500-4,500 pages of 4 KiB per step here, ~7,000 on the small benchmark case).
    # With the setting the step reuses the freed memory: 0-1 faults per step in isolation, but a
    # loaded machine adds faults the process did not cause (up to 576 per step seen in one CI run of
    # the full suite), so an absolute ceiling is flaky. The claim is a relative one: at least a 5x drop
    # (a malloc left alone faults in the same ~before pages again and fails it by a wide margin).
    assert got["before"] >= 100, got
    assert got["after"] <= got["before"] / 5, got
    assert got["threads"] == 1


def test_off_sets_threads_and_leaves_malloc_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(cpu, "keep_freed_memory", lambda: calls.append(1))
    threads = torch.get_num_threads()
    try:
        cpu.configure_cpu(2, keep_memory=False)
        assert torch.get_num_threads() == 2 and calls == []
        cpu.configure_cpu(0, keep_memory=True)
        assert torch.get_num_threads() == 2 and calls == [1]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "name, value",
    [
        ("MALLOC_MMAP_THRESHOLD_", "131072"),
        ("MALLOC_TRIM_THRESHOLD_", "0"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
    ],
)
def test_users_malloc_environment_wins(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    # The user chose how malloc behaves (say, small blocks mmapped: less memory, more faults).
    monkeypatch.setenv(name, value)
    assert cpu.keep_freed_memory() is False


def test_applies_on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*cpu.MALLOC_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    assert cpu.keep_freed_memory() is True
