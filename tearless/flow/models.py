"""Built-in velocity models: a small MLP for 2-D points and a small conv net for tiny images.

Every model is a callable ``velocity(x_t, t, cond) -> v`` (see :class:`tearless.flow.sampler.VelocityModel`).
The built-in ones read ``cond`` as a (B,) int64 tensor of prompt ids, id ``num_prompts`` being the null
prompt of classifier-free guidance; they save and load as a directory holding ``model.safetensors`` and
``flow_model.json`` (the class and its constructor arguments). The diffusers SD3 adapter is in
:mod:`tearless.flow.sd3`.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn


def time_embedding(t: Tensor, dim: int) -> Tensor:
    r"""Sinusoidal features of t ∈ [0, 1]: :math:`[\sin(1000 t f_k), \cos(1000 t f_k)]`, f_k = 10⁻⁴ᵏ/ᵈ."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = 1000.0 * t.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], -1).to(t.dtype)


class MLPVelocity(nn.Module):
    """v(x, t, c) for 2-D points: an MLP over [x, sinusoidal t-embedding, prompt embedding], SiLU."""

    def __init__(self, num_prompts: int, dim: int = 2, hidden: int = 128, depth: int = 3, emb: int = 32):
        super().__init__()
        self.config = {"num_prompts": num_prompts, "dim": dim, "hidden": hidden, "depth": depth, "emb": emb}
        self.emb_dim = emb
        self.prompt_emb = nn.Embedding(num_prompts + 1, emb)
        sizes = [dim + 2 * emb] + [hidden] * depth
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        h = torch.cat([x, time_embedding(t, self.emb_dim), self.prompt_emb(cond)], -1)
        for layer in self.layers:
            h = nn.functional.silu(layer(h))
        return self.out(h)

    def lora_targets(self) -> list[str]:
        """Names of the linear layers LoRA adapts."""
        return [f"layers.{i}" for i in range(len(self.layers))] + ["out"]


class _ResBlock(nn.Module):
    """conv → FiLM(t, prompt) → SiLU → conv, added back to the input."""

    def __init__(self, channels: int, emb: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.film = nn.Linear(emb, 2 * channels)

    def forward(self, h: Tensor, e: Tensor) -> Tensor:
        scale, shift = self.film(e)[:, :, None, None].chunk(2, dim=1)
        y = self.conv1(nn.functional.silu(h)) * (1 + scale) + shift
        return h + self.conv2(nn.functional.silu(y))


class ConvVelocity(nn.Module):
    """v(x, t, c) for tiny images (B, C, H, W): residual 3×3 conv blocks with FiLM conditioning.

    Two coordinate channels (x and y in [−1, 1]) are appended to the input, so the net can tie what it
    draws to where (a plain conv net is translation-equivariant and could not learn "in the left half").
    """

    def __init__(self, num_prompts: int, channels: int = 1, width: int = 32, blocks: int = 3, emb: int = 64):
        super().__init__()
        self.config = {
            "num_prompts": num_prompts,
            "channels": channels,
            "width": width,
            "blocks": blocks,
            "emb": emb,
        }
        self.emb_dim = emb
        self.prompt_emb = nn.Embedding(num_prompts + 1, emb)
        self.emb_mlp = nn.Sequential(nn.Linear(2 * emb, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.conv_in = nn.Conv2d(channels + 2, width, 3, padding=1)
        self.blocks = nn.ModuleList(_ResBlock(width, emb) for _ in range(blocks))
        self.conv_out = nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        b, _, hgt, wid = x.shape
        ys = torch.linspace(-1, 1, hgt, device=x.device, dtype=x.dtype)
        xs = torch.linspace(-1, 1, wid, device=x.device, dtype=x.dtype)
        grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij")).expand(b, 2, hgt, wid)
        e = self.emb_mlp(torch.cat([time_embedding(t, self.emb_dim), self.prompt_emb(cond)], -1))
        h = self.conv_in(torch.cat([x, grid], 1))
        for block in self.blocks:
            h = block(h, e)
        return self.conv_out(nn.functional.silu(h))

    def lora_targets(self) -> list[str]:
        """Names of the layers LoRA adapts: convs, FiLM, and the embedding MLP (so that an adapter can
        amplify a prompt difference the base model learned to ignore, like a text encoder's)."""
        names = ["conv_in", "conv_out", "emb_mlp.0", "emb_mlp.2"]
        for i in range(len(self.blocks)):
            names += [f"blocks.{i}.conv1", f"blocks.{i}.conv2", f"blocks.{i}.film"]
        return names


MODEL_CLASSES: dict[str, type[nn.Module]] = {"mlp": MLPVelocity, "conv": ConvVelocity}


def save_flow_model(model: nn.Module, path: str | os.PathLike, **meta: Any) -> Path:
    """Write ``model`` (a built-in velocity model) to directory ``path``; ``meta`` lands in the JSON."""
    from safetensors.torch import save_file

    kind = next((k for k, cls in MODEL_CLASSES.items() if type(model) is cls), None)
    if kind is None:
        raise TypeError(f"only built-in flow models can be saved this way, got {type(model).__name__}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    info = {"kind": kind, "config": model.config, **meta}
    (path / "flow_model.json").write_text(json.dumps(info, indent=2))
    return path


def load_flow_model(path: str | os.PathLike) -> tuple[nn.Module, dict[str, Any]]:
    """The model saved in ``path`` by :func:`save_flow_model` and the JSON metadata beside it."""
    from safetensors.torch import load_file

    path = Path(path)
    info_file = path / "flow_model.json"
    if not info_file.is_file():
        raise FileNotFoundError(
            f"{path} is not a tearless flow model directory (no flow_model.json); make one with "
            "`tearless flow-pretrain` or point model.path at its output"
        )
    info = json.loads(info_file.read_text())
    if info.get("kind") not in MODEL_CLASSES:
        raise ValueError(
            f"{info_file}: unknown model kind {info.get('kind')!r}; known: {sorted(MODEL_CLASSES)}"
        )
    model = MODEL_CLASSES[info["kind"]](**info["config"])
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model, info
