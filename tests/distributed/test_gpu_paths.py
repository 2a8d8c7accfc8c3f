"""The GPU placement's process group, device and offload logic, checked where it can be on a CPU.

A CUDA run's default group is ``cpu:gloo,cuda:nccl`` (:func:`process_group_backend`); the CPU tests
build the same group with gloo in NCCL's place (``cpu:gloo,cuda:gloo``), which routes each device
type exactly as the real one does, and show that an NCCL-style group bound to cuda alone refuses the
CPU collectives the ranks run (the finite-gradient vote, the buffer broadcast of an offloaded model).
What only a GPU can show (NCCL itself, the device-to-host copies of an offloaded optimizer) is in
``benchmarks/gpu_check.py`` and in the CUDA-only tests below, skipped here with that reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tearless.config import ConfigError, load_config
from tearless.distributed.fsdp import move_optimizer_state, optimizer_state_moves, process_group_backend
from tearless.workers.spec import resolve_device

# One process, world size 1, the group built from process_group_backend("cuda") with gloo standing in
# for NCCL: the vote and the CPU buffer broadcast of shard_from_rank0 (param_offload's setup path).
GROUP_SCRIPT = textwrap.dedent(
    """
    import sys, socket, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from tearless.distributed.fsdp import process_group_backend, shard_from_rank0
    from tearless.workers.schedule import all_ranks_agree

    backend = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        votes = [all_ranks_agree(True, world=2), all_ranks_agree(False, world=2)]
        mesh = init_device_mesh("cpu", (1,))

        def build(real):
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)]))

        model = shard_from_rank0(build, mesh, rank=0, device="cpu")
        print("votes", votes, "params", sum(p.numel() for p in model.parameters()))
    except RuntimeError as e:
        print("refused:", str(e).splitlines()[0])
    finally:
        dist.destroy_process_group()
    """
)


def run_group(backend: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", GROUP_SCRIPT, backend], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_gpu_group_carries_gloo_for_cpu_tensors():
    assert process_group_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert process_group_backend("cpu") == "gloo"
    stand_in = process_group_backend("cuda").replace("nccl", "gloo")
    # Both votes come back (True, then False: the minimum), and the model's 2 × (3·3 + 3) = 24
    # parameters were broadcast into its shards through the CPU side of the group.
    assert run_group(stand_in) == "votes [True, False] params 24"


def test_a_group_bound_to_cuda_alone_refuses_the_cpu_vote():
    # The group the GPU placement used to build ("nccl": cuda only), with gloo standing in for NCCL.
    assert run_group("cuda:gloo") == "refused: No backend type associated with device type cpu"


@pytest.mark.parametrize(
    ("device", "param_offload", "optimizer_offload", "moves"),
    [
        ("cpu", False, True, False),  # nothing to offload to on a CPU run
        ("cuda", False, False, False),
        ("cuda", False, True, True),  # the state visits the GPU for each step
        ("cuda", True, False, False),  # parameters (and so AdamW's step) live in CPU memory
        ("cuda", True, True, False),  # ... and the state stays beside them
    ],
)
def test_optimizer_state_moves_only_beside_parameters_on_the_gpu(
    device, param_offload, optimizer_offload, moves
):
    assert (
        optimizer_state_moves(device, param_offload=param_offload, optimizer_offload=optimizer_offload)
        is moves
    )


def adam_with_state(device: str) -> torch.optim.AdamW:
    p = torch.nn.Parameter(torch.arange(6.0, device=device))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.linspace(-1, 1, 6, device=device)
    opt.step()
    return opt


def test_moving_optimizer_state_to_its_own_device_changes_nothing():
    opt = adam_with_state("cpu")
    before = {k: v.clone() for k, v in next(iter(opt.state.values())).items()}
    move_optimizer_state(opt, "cpu")
    after = next(iter(opt.state.values()))
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device-to-host copy needs a GPU")
def test_offloaded_state_is_whole_when_read_right_after_the_move():
    opt = adam_with_state("cuda")
    state = next(iter(opt.state.values()))
    expected = {k: v.cpu() for k, v in state.items()}
    move_optimizer_state(opt, "cpu")
    moved = next(iter(opt.state.values()))
    assert all(moved[k].device.type == "cpu" and torch.equal(moved[k], expected[k]) for k in expected)


def test_auto_device_is_decided_by_the_process_that_asks():
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match=r"^trainer\.device=cuda, but this process sees no CUDA") as e:
        resolve_device("cuda")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor", "critic.model"])
def test_float16_training_without_a_loss_scaler_is_refused(key):
    with pytest.raises(ConfigError, match=rf"{key}\.fsdp_config\.param_dtype: float16 training needs"):
        load_config(None, [f"{key}.fsdp_config.param_dtype=float16"], notify=lambda _: None)


def test_a_float16_reference_is_allowed():
    cfg = load_config(None, ["actor_rollout_ref.ref.fsdp_config.param_dtype=fp16"], notify=lambda _: None)
    assert cfg.actor_rollout_ref.ref.fsdp_config.param_dtype == "fp16"


def dry_run(tmp_path: Path, *tier: str, passed: int) -> dict[str, dict]:
    """``benchmarks/gpu_check.py --dry-run`` (with ``tier``'s arguments) in a fresh process: every check
    passed (``passed`` of them), their results by name."""
    script = Path(__file__).parents[2] / "benchmarks" / "gpu_check.py"
    env = {**os.environ, "TEARLESS_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(script), "--dry-run", *tier, "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    last = out.stdout.strip().splitlines()[-1]
    assert last == f"gpu_check: {passed} passed, 0 failed", out.stdout + out.stderr
    return {r["check"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())}


@pytest.mark.slow
def test_the_gpu_checks_dry_run_passes_on_cpu(tmp_path):
    # benchmarks/gpu_check.py runs tearless's GPU paths on a GPU; its dry run is the same code on CPU
    # (gloo for NCCL, no CUDA graphs, tiny sizes), so the script cannot rot between GPU sessions.
    results = dry_run(tmp_path, passed=9)
    assert results["grpo_fp32_resume"]["resumed"] and results["grpo_fp32_resume"]["steps"] == 2
    assert results["rank_sharded_logprobs"]["sharded_class"].startswith("FSDP")
    assert results["decode_loop"]["static_greedy_agree"] >= 0.99


@pytest.mark.slow
def test_the_gpu_checks_real_scale_tier_dry_run_passes_on_cpu(tmp_path):
    # The real-scale tier (benchmarks/gpu_scale.py: the trainer's update and the decode loop at
    # Qwen2.5's shapes) on a tiny shape, so it cannot rot between GPU sessions either.
    results = dry_run(tmp_path, "--tier", "real", passed=4)
    for variant in ("compiled", "copies"):
        assert (
            results[f"update_dry_{variant}"]["finite"]
            and results[f"update_dry_{variant}"]["tokens_per_s"] > 0
        )
    assert results["update_dry"]["finite"] and results["update_dry"]["tokens_per_s"] > 0
    assert results["update_dry"]["mfu"] is None  # no card: no peak to divide by
    assert results["decode_dry"]["tok_s"] > 0 and results["decode_dry"]["share_of_limit"] is None


@pytest.mark.slow
def test_the_gpu_checks_fit_tier_dry_run_passes_on_cpu(tmp_path):
    # The fit tier (the largest models per card: 1.5B full, 7B LoRA with and without compute copies) on
    # a tiny shape: two steps each, and the bytes each model holds equal the start-up estimate's
    # parameters but for the biases it leaves out (q/k/v's, 0.1-0.2% of this shape): the LoRA base held
    # in bf16 by compute copies (bf16 forced on in the dry run) included.
    results = dry_run(tmp_path, "--tier", "fit", passed=3)
    assert results.keys() == {"fit_1.5b", "fit_7b_lora", "fit_7b_lora_copies"}
    for r in results.values():
        assert r["finite"] and 1.0 < r["parameters_over_estimate"] < 1.005, r


def test_a_fit_check_without_loras_packages_fails_before_building_its_model(monkeypatch):
    # The GPU machine has only the wheels carried to it: a LoRA fit check without peft (or the
    # accelerate peft imports) says so at once instead of building a 7B model and failing in peft.
    import importlib.util

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        import gpu_scale
    finally:
        sys.path.pop(0)
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find(name, *a)
    )
    monkeypatch.setattr(gpu_scale, "_fit", lambda *a, **k: pytest.fail("built a model"))
    numbers = gpu_scale.fit(None, "7b_lora", "cpu", 16, 8, 16)
    assert numbers == {
        "finite": False,
        "why": "LoRA needs accelerate: carry their wheels (docs/development.md)",
    }


def test_the_real_scale_tiers_flops_and_bandwidth_limit_by_hand():
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    try:
        import gpu_scale
    finally:
        sys.path.pop(0)
    from transformers import Qwen2Config

    assert gpu_scale.card_peaks("NVIDIA H200") == (989e12, 4.8e12)
    assert gpu_scale.card_peaks("NVIDIA H100 80GB HBM3") == (989e12, 3.35e12)
    assert gpu_scale.card_peaks("NVIDIA H100 PCIe") == (756e12, 2.0e12)
    assert gpu_scale.card_peaks("NVIDIA A10G") is None
    qwen = Qwen2Config(**gpu_scale.SHAPES["0.5b"])
    # N = 494,005,120, of which the tied table V·h = 136,134,656. 128 rows of 128 + 1,024 tokens: s =
    # 1,151 forwarded each, 1,024 through the head. 6·357,870,464·128·1,151 = 316,346,038,321,152;
    # 6·136,134,656·128·1,024 = 107,060,649,787,392; attention 6·24·896·128·1,151² =
    # 21,879,183,900,672. Total 445,285,872,009,216 (≈ 3.0e9 FLOP per token).
    assert gpu_scale.update_flops(qwen, 128, 1024, 128) == 445_285_872_009_216
    # Decode at 4.8 TB/s: bf16 weights 988,010,240 B and KV 2·24·128·2·128·(128 + 512) = 1,006,632,960
    # B per step: 128 · 4.8e12 / 1,994,643,200 = 308,025 tokens/s.
    assert gpu_scale.decode_limit(qwen, 128, 1024, 128, 4.8e12) == pytest.approx(308_025, abs=1)
