r"""Samplers for rectified-flow velocity models: the Flow-GRPO SDE with exact per-step log-probs, and the ODE.

Conventions (SD3's rectified flow): :math:`x_t = (1-t)\,x_0 + t\,\epsilon` with :math:`x_0` data and
:math:`\epsilon \sim \mathcal N(0, I)`; the model predicts :math:`v = \epsilon - x_0`; sampling runs
from t = 1 (noise) to t = 0 over a decreasing schedule :math:`1 = \sigma_0 > \dots > \sigma_T = 0`, with
the signed step :math:`\Delta t = \sigma_{i+1} - \sigma_i < 0` and :math:`h = -\Delta t`.

The ODE :math:`dx = v\,dt` has the same marginals as the reverse SDE (Flow-GRPO, Liu et al. 2025)

.. math:: dx = \Big[v + \frac{\sigma_t^2}{2t}\big(x + (1-t)v\big)\Big]dt + \sigma_t\,dW,
          \qquad \sigma_t = a\sqrt{\frac{t}{1-t}}

(the bracket adds :math:`-\tfrac{\sigma_t^2}{2}\nabla\log p_t` with the score :math:`-(x+(1-t)v)/t`),
where a is the noise level. At t = 1 the ratio is infinite, so 1 − t is replaced by 1 − σ_1 (the second
value of the schedule), as Flow-GRPO does. One Euler–Maruyama step is the Gaussian policy

.. math:: x_{t+\Delta t} \sim \mathcal N\big(\mu_\theta(x_t),\ (\sigma_t\sqrt h)^2 I\big),\qquad
          \mu_\theta = x_t + \Delta t\Big[v + \frac{\sigma_t^2}{2t}\big(x_t + (1-t)v\big)\Big],

whose log-density is exact. a = 0 gives the plain Euler ODE step.

The step and its log-density are computed in float32 (or wider) whatever the model's dtype, as
Flow-GRPO does: the model is fed x in the dtype the caller sampled ``noise`` in (e.g. bfloat16), and
its velocity is upcast before the step. Computed in bfloat16, the per-element-mean log-prob of a
16×64×64 latent is off by 5e-3 (measured), fifty times Flow-GRPO's clip range of 1e-4.

A velocity model is any callable ``velocity(x_t, t, cond) -> v`` (:class:`VelocityModel`); ``t`` is a
(B,) tensor, ``cond`` whatever the model reads its prompt from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor


class VelocityModel(Protocol):
    """``velocity(x_t, t, cond) -> v``: x_t (B, ...), t (B,) in [0, 1], v shaped like x_t."""

    def __call__(self, x: Tensor, t: Tensor, cond: Any) -> Tensor: ...


def sigma_schedule(num_steps: int, shift: float = 1.0) -> Tensor:
    r"""The T + 1 times :math:`\sigma_i = \frac{k s_i}{1 + (k-1)s_i}` of a linear grid s from 1 to 0.

    k = ``shift`` (SD3 uses 3: more steps at high noise); k = 1 is the uniform grid. float32, (T+1,).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1.0 + (shift - 1.0) * s)).float()


def sde_sigma(t: float, noise_level: float, sigma_after_one: float) -> float:
    r""":math:`\sigma_t = a\sqrt{t/(1-t)}`, with 1 − t replaced by 1 − ``sigma_after_one`` at t = 1."""
    denominator = 1.0 - (sigma_after_one if t >= 1.0 else t)
    return noise_level * math.sqrt(t / denominator)


def guided_velocity(
    model: VelocityModel,
    x: Tensor,
    t: float,
    cond: Any,
    *,
    guidance_scale: float = 1.0,
    uncond: Any = None,
) -> Tensor:
    r"""Classifier-free guidance: :math:`v = v_u + w\,(v_c - v_u)` with w = ``guidance_scale``.

    w = 1 (or no ``uncond``) is the conditional velocity alone, one forward pass. The unconditional
    branch runs without autograd, so gradients flow only through :math:`v_c` (Flow-GRPO's training
    recomputation detaches it the same way); when sampling, everything is under no-grad anyway.
    """
    tt = torch.full((x.shape[0],), float(t), dtype=x.dtype, device=x.device)
    v_cond = model(x, tt, cond)
    if guidance_scale == 1.0 or uncond is None:
        return v_cond
    with torch.no_grad():
        v_uncond = model(x, tt, uncond)
    return v_uncond + guidance_scale * (v_cond - v_uncond)


def gaussian_log_prob(sample: Tensor, mean: Tensor, std: float, reduce: str = "mean") -> Tensor:
    r"""Log-density of ``sample`` under :math:`\mathcal N(\mu, s^2 I)`, one value per row, (B,).

    Per element: :math:`-\frac{(x-\mu)^2}{2s^2} - \log s - \tfrac12\log 2\pi`. ``reduce="mean"``
    averages over the non-batch elements, as Flow-GRPO does: a 64×64×16 latent has 65,536 elements, and
    a sum would make every log-ratio 65,536 times larger, so an update that moves each element a little
    would push the ratio far outside any clip range. With the mean, ratios stay near 1 and the clip
    range does not depend on the resolution (hence Flow-GRPO's tiny clip of 1e-4). ``sum`` is the exact
    joint log-density.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    if std <= 0:
        raise ValueError(f"the step std must be > 0 for a log-probability, got {std} (noise_level 0?)")
    per_element = -((sample - mean) ** 2) / (2.0 * std**2) - math.log(std) - 0.5 * math.log(2.0 * math.pi)
    flat = per_element.reshape(per_element.shape[0], -1)
    return flat.mean(-1) if reduce == "mean" else flat.sum(-1)


@dataclass
class StepParams:
    """The numbers of denoising step i: times t → t_next, σ_t of the SDE, and the step std σ_t√h."""

    t: float
    t_next: float
    sigma: float
    std: float


def step_params(sigmas: Tensor, i: int, noise_level: float) -> StepParams:
    """:class:`StepParams` of step ``i`` of the schedule ``sigmas`` (T+1,)."""
    t, t_next = float(sigmas[i]), float(sigmas[i + 1])
    if not t > t_next:
        raise ValueError(f"sigmas must decrease, got sigmas[{i}]={t} <= sigmas[{i + 1}]={t_next}")
    sigma = sde_sigma(t, noise_level, float(sigmas[1]))
    return StepParams(t, t_next, sigma, sigma * math.sqrt(t - t_next))


def sde_step_mean(x: Tensor, v: Tensor, p: StepParams) -> Tensor:
    r""":math:`\mu = x + \Delta t\,[v + \frac{\sigma_t^2}{2t}(x + (1-t)v)]` (the Euler step when σ_t = 0)."""
    dt = p.t_next - p.t
    return x + dt * (v + (p.sigma**2 / (2.0 * p.t)) * (x + (1.0 - p.t) * v))


@dataclass
class Trajectory:
    """One batch of SDE rollouts.

    ``latents`` (B, T+1, ...) holds x at every time of ``sigmas`` (latents[:, 0] the initial noise,
    latents[:, -1] the sample); ``log_probs`` (B, T) the log-prob of each step's draw under the
    sampling weights. Both are in the compute dtype (float32 or wider); ``model_dtype`` is the dtype
    the model was fed x in (``noise``'s), which :func:`step_log_prob` must feed it again.
    """

    latents: Tensor
    log_probs: Tensor
    sigmas: Tensor
    model_dtype: torch.dtype = torch.float32

    @property
    def samples(self) -> Tensor:
        return self.latents[:, -1]


@torch.no_grad()
def sample_sde(
    model: VelocityModel,
    cond: Any,
    noise: Tensor,
    sigmas: Tensor,
    *,
    noise_level: float = 0.7,
    guidance_scale: float = 1.0,
    uncond: Any = None,
    generator: torch.Generator | None = None,
    reduce: str = "mean",
) -> Trajectory:
    """Run the SDE from ``noise`` (x at t = σ_0) through the schedule, recording every x and log-prob.

    The model sees x in ``noise``'s dtype; the steps, the draws and the log-probs are float32 (or
    wider), and so are the stored latents.
    """
    model_dtype = noise.dtype
    x = noise.to(_compute_dtype(noise))
    latents, log_probs = [x], []
    for i in range(len(sigmas) - 1):
        p = step_params(sigmas, i, noise_level)
        v = guided_velocity(model, x.to(model_dtype), p.t, cond, guidance_scale=guidance_scale, uncond=uncond)
        mean = sde_step_mean(x, v.to(x.dtype), p)
        z = torch.randn(x.shape, generator=generator, dtype=x.dtype, device="cpu").to(x.device)
        x = mean + p.std * z
        log_probs.append(gaussian_log_prob(x, mean, p.std, reduce))
        latents.append(x)
    return Trajectory(torch.stack(latents, 1), torch.stack(log_probs, 1), sigmas, model_dtype)


@torch.no_grad()
def sample_ode(
    model: VelocityModel,
    cond: Any,
    noise: Tensor,
    sigmas: Tensor,
    *,
    guidance_scale: float = 1.0,
    uncond: Any = None,
) -> Tensor:
    """Deterministic Euler ODE sampling (x ← x + Δt·v) from ``noise``; returns the final sample.

    As :func:`sample_sde`: the model sees ``noise``'s dtype, the steps run in float32 (or wider).
    """
    x = noise.to(_compute_dtype(noise))
    for i in range(len(sigmas) - 1):
        t, t_next = float(sigmas[i]), float(sigmas[i + 1])
        v = guided_velocity(model, x.to(noise.dtype), t, cond, guidance_scale=guidance_scale, uncond=uncond)
        x = x + (t_next - t) * v.to(x.dtype)
    return x


def step_log_prob(
    model: VelocityModel,
    x: Tensor,
    next_x: Tensor,
    cond: Any,
    p: StepParams,
    *,
    guidance_scale: float = 1.0,
    uncond: Any = None,
    reduce: str = "mean",
    model_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob (B,) of the stored transition x → ``next_x`` under the current weights, and the mean μ_θ.

    The model is fed x in ``model_dtype`` (the trajectory's; None = x's own dtype); the mean and the
    log-prob are float32 (or wider). With the weights used for sampling (and the same batch) this
    reproduces the sampler's log-prob exactly: both evaluate the same expression on the same stored
    tensors.
    """
    compute = _compute_dtype(x)
    v = guided_velocity(
        model, x.to(model_dtype or x.dtype), p.t, cond, guidance_scale=guidance_scale, uncond=uncond
    )
    mean = sde_step_mean(x.to(compute), v.to(compute), p)
    return gaussian_log_prob(next_x.to(compute), mean, p.std, reduce), mean


def _compute_dtype(x: Tensor) -> torch.dtype:
    # bfloat16 keeps 8 bits of mantissa: (x' − μ)²/(2s²) would lose about two significant digits.
    return torch.promote_types(x.dtype, torch.float32)
