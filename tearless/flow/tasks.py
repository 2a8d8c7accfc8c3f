"""Embedded Flow-GRPO tasks: procedural data for pre-training, a rule reward for RL, quality metrics.

A task (:class:`FlowTask`) tells the trainer how many prompts there are, the shape of one sample, how
to turn prompt ids into the model's ``cond`` (and the null ``uncond`` of classifier-free guidance),
how to draw pre-training data, and how to score samples. A reward is a plain function
``reward(samples (B, ...), prompt_ids (B,)) -> (B,) float``; :func:`load_reward_fn` loads a user's.

- ``points2d``: 4 prompts; prompt c is a mixture of 4 Gaussians (std 0.15) on a radius-2 ring at
  angles 2πj/4 + cπ/8. The reward asks for one mode only, exp(−‖x − m_c‖²/(2·0.4²)) with m_c the j = 0
  centre: the base model puts about a quarter of its mass there.
- ``shapes``: 4 prompts = shapes (1×4 bar, 4×1 bar, 3×3 square, 2×2 square; doubled at 16×16),
  drawn white on black at a uniform random position, so the pre-trained model draws the requested
  shape anywhere. The reward asks for the requested shape in the left half, GenEval's "object" and
  "position" clauses: 1 if the image holds the requested shape (bounding box of the lit pixels of the
  shape's size, lit-pixel count within one of its area) times the fraction of its lit pixels in the
  left half: 1 for the right shape wholly on the left, 0.5 for one straddling the middle evenly, 0 for
  a wrong shape. The graded position clause gives RL a signal from every valid sample; the strict 0/1
  version (centroid in the left half) is reported as ``strict``.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from tearless.flow.models import ConvVelocity, MLPVelocity
from tearless.userfiles import check_user_file

RewardFn = Callable[[Tensor, Tensor], Tensor]
TASKS_VERSION = 1  # bump when a task's data change, so cached pre-trained base models are rebuilt


class FlowTask(Protocol):
    """What the trainer needs of a task; ``data`` and ``build_model`` only pre-training needs, and a
    task with ``to_images(samples) -> (B, C, H, W) in [0, 1]`` gets a before/after PNG grid."""

    name: str
    num_prompts: int
    sample_shape: tuple[int, ...]

    def prompt_names(self) -> list[str]: ...
    def data(self, prompt_ids: Tensor, generator: torch.Generator) -> Tensor: ...
    def cond(self, prompt_ids: Tensor) -> Any: ...
    def uncond(self, prompt_ids: Tensor) -> Any: ...
    def reward(self, samples: Tensor, prompt_ids: Tensor) -> Tensor: ...
    def metrics(self, samples: Tensor, prompt_ids: Tensor) -> dict[str, float]: ...
    def build_model(self, **kwargs: Any) -> nn.Module: ...


class _IdConditioned:
    """cond = the prompt ids; the null prompt of CFG is id ``num_prompts``."""

    num_prompts: int

    def cond(self, prompt_ids: Tensor) -> Tensor:
        return prompt_ids

    def uncond(self, prompt_ids: Tensor) -> Tensor:
        return torch.full_like(prompt_ids, self.num_prompts)


class Points2D(_IdConditioned):
    """Class-conditional 2-D point clouds with a reward for one requested mode (see the module doc)."""

    name = "points2d"
    sample_shape = (2,)

    def __init__(
        self,
        num_prompts: int = 4,
        modes: int = 4,
        radius: float = 2.0,
        std: float = 0.15,
        reward_width: float = 0.4,
        hit_radius: float = 0.5,
    ):
        self.num_prompts, self.modes, self.radius, self.std = num_prompts, modes, radius, std
        self.reward_width, self.hit_radius = reward_width, hit_radius

    def prompt_names(self) -> list[str]:
        return [f"class {c}" for c in range(self.num_prompts)]

    def centres(self, prompt_ids: Tensor) -> Tensor:
        """(B, modes, 2): the mode centres of each row's prompt."""
        j = torch.arange(self.modes, dtype=torch.float32)
        angle = 2 * math.pi * j[None] / self.modes + prompt_ids.float()[:, None] * math.pi / (2 * self.modes)
        return self.radius * torch.stack([torch.cos(angle), torch.sin(angle)], -1)

    def data(self, prompt_ids: Tensor, generator: torch.Generator) -> Tensor:
        mode = torch.randint(self.modes, prompt_ids.shape, generator=generator)
        centre = self.centres(prompt_ids)[torch.arange(len(prompt_ids)), mode]
        return centre + self.std * torch.randn(len(prompt_ids), 2, generator=generator)

    def reward(self, samples: Tensor, prompt_ids: Tensor) -> Tensor:
        target = self.centres(prompt_ids)[:, 0]
        return torch.exp(-(samples.float() - target).square().sum(-1) / (2 * self.reward_width**2))

    def metrics(self, samples: Tensor, prompt_ids: Tensor) -> dict[str, float]:
        """Reward; ``target_hit`` (within hit_radius of the requested mode); ``on_mode`` (within
        hit_radius of any mode of the prompt: the samples are still data-like); ``spread`` (mean
        distance to the nearest mode centre, a diversity proxy)."""
        dist = (samples.float()[:, None] - self.centres(prompt_ids)).norm(dim=-1)
        return {
            "reward": float(self.reward(samples, prompt_ids).mean()),
            "target_hit": float((dist[:, 0] < self.hit_radius).float().mean()),
            "on_mode": float((dist.min(-1).values < self.hit_radius).float().mean()),
            "spread": float(dist.min(-1).values.mean()),
        }

    def build_model(self, **kwargs: Any) -> nn.Module:
        return MLPVelocity(self.num_prompts, **kwargs)


class Shapes(_IdConditioned):
    """Procedurally drawn tiny images: the requested shape, wanted in the left half (see the module doc)."""

    name = "shapes"
    SHAPES = (("bar1x4", 1, 4), ("bar4x1", 4, 1), ("square3", 3, 3), ("square2", 2, 2))

    def __init__(self, image_size: int = 8):
        if image_size not in (8, 16):
            raise ValueError(f"shapes: image_size must be 8 or 16, got {image_size}")
        self.size = image_size
        self.scale = image_size // 8
        self.num_prompts = len(self.SHAPES)
        self.sample_shape = (1, image_size, image_size)

    def prompt_names(self) -> list[str]:
        return [s[0] for s in self.SHAPES]

    def _dims(self, prompt_ids: Tensor) -> tuple[Tensor, Tensor]:
        hs = torch.tensor([s[1] for s in self.SHAPES])[prompt_ids] * self.scale
        ws = torch.tensor([s[2] for s in self.SHAPES])[prompt_ids] * self.scale
        return hs, ws

    def data(self, prompt_ids: Tensor, generator: torch.Generator) -> Tensor:
        hs, ws = self._dims(prompt_ids)
        n = len(prompt_ids)
        top = (torch.rand(n, generator=generator) * (self.size - hs + 1)).long()
        left = (torch.rand(n, generator=generator) * (self.size - ws + 1)).long()
        idx = torch.arange(self.size)
        rows = (idx[None] >= top[:, None]) & (idx[None] < (top + hs)[:, None])
        cols = (idx[None] >= left[:, None]) & (idx[None] < (left + ws)[:, None])
        lit = rows[:, :, None] & cols[:, None, :]
        return (lit.float() * 2 - 1)[:, None]

    def _checks(self, samples: Tensor, prompt_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        lit = samples[:, 0] > 0
        hs, ws = self._dims(prompt_ids)
        count = lit.sum((1, 2))
        any_row, any_col = lit.any(2), lit.any(1)
        idx = torch.arange(self.size)
        big = self.size + 1

        def extent(mask: Tensor) -> Tensor:
            first = torch.where(mask, idx, big).amin(1)
            last = torch.where(mask, idx, -1).amax(1)
            return last - first + 1

        shape_ok = (extent(any_row) == hs) & (extent(any_col) == ws) & ((count - hs * ws).abs() <= 1)
        col_centroid = (lit.float() * idx.float()).sum((1, 2)) / count.clamp(min=1)
        left_ok = (col_centroid < (self.size - 1) / 2) & (count > 0)
        in_left = (lit[:, :, : self.size // 2].sum((1, 2)) / count.clamp(min=1)).float()
        return shape_ok, left_ok, in_left

    def reward(self, samples: Tensor, prompt_ids: Tensor) -> Tensor:
        shape_ok, _, in_left = self._checks(samples, prompt_ids)
        return shape_ok.float() * in_left

    def metrics(self, samples: Tensor, prompt_ids: Tensor) -> dict[str, float]:
        """Reward; ``shape_ok`` (the requested shape is drawn, anywhere: the quality clause);
        ``left_ok`` (the lit pixels' centroid is in the left half); ``strict`` (both, 0/1)."""
        shape_ok, left_ok, in_left = self._checks(samples, prompt_ids)
        return {
            "reward": float((shape_ok.float() * in_left).mean()),
            "shape_ok": float(shape_ok.float().mean()),
            "left_ok": float(left_ok.float().mean()),
            "strict": float((shape_ok & left_ok).float().mean()),
        }

    def build_model(self, **kwargs: Any) -> nn.Module:
        return ConvVelocity(self.num_prompts, channels=1, **kwargs)

    def to_images(self, samples: Tensor) -> Tensor:
        """Samples (values in about [−1, 1]) as images in [0, 1]."""
        return (samples.clamp(-1, 1) + 1) / 2


TASKS: dict[str, Callable[..., FlowTask]] = {"points2d": Points2D, "shapes": Shapes}


def make_task(name: str, *, image_size: int = 8) -> FlowTask:
    """The embedded task ``name`` (``points2d`` or ``shapes``)."""
    if name == "points2d":
        return Points2D()
    if name == "shapes":
        return Shapes(image_size)
    raise ValueError(f"unknown flow task {name!r}; known: {', '.join(TASKS)}")


def load_reward_fn(spec: str) -> RewardFn:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` → the function.

    The function takes ``(samples, prompt_ids)`` (tensors, batch first) and returns (B,) rewards.
    """
    if ":" not in spec:
        raise ValueError(f"task.reward_fn {spec!r} must be 'module:function' or 'file.py:function'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not os.path.lexists(path):
            raise FileNotFoundError(f"task.reward_fn: file {where!r} does not exist")
        check_user_file(path, key="task.reward_fn", kind="code")
        module_spec = importlib.util.spec_from_file_location(f"_tearless_flow_reward_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"task.reward_fn: {where!r} has no function {name!r}")
    return fn


def image_grid(rows: list[Tensor], path: str | Path, *, upscale: int = 4, gap: int = 1) -> Path:
    """Save image batches as one PNG: ``rows`` are (N, C, H, W) tensors in [0, 1] (C = 1 grey or 3
    RGB), one grid row each, separated by grey lines."""
    from PIL import Image

    n = max(len(r) for r in rows)
    c, h, w = rows[0].shape[-3:]
    canvas = torch.full((c, len(rows) * (h + gap) - gap, n * (w + gap) - gap), 0.35)
    for i, batch in enumerate(rows):
        for j, img in enumerate(batch):
            top, left = i * (h + gap), j * (w + gap)
            canvas[:, top : top + h, left : left + w] = img.float().clamp(0, 1)
    pixels = (canvas * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    image = Image.fromarray(pixels[:, :, 0] if c == 1 else pixels, mode="L" if c == 1 else "RGB")
    image = image.resize((image.width * upscale, image.height * upscale), Image.NEAREST)
    path = Path(path)
    image.save(path)
    return path
