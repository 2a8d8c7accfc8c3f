r"""KL estimators (registered in :data:`KL_ESTIMATORS`) and KL-coefficient controllers.

x = ``log_prob`` = log π(y_t), y = ``ref_log_prob`` = log π_ref(y_t), on tokens sampled from π, so that
each estimator's expectation is (an estimate of) KL(π ‖ π_ref) (Schulman, "Approximating KL divergence",
2020). Shapes: (B, T) in, (B, T) out, except ``full``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tearless.algos._registry import registrar

KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {}
register_kl_estimator = registrar(KL_ESTIMATORS, "KL estimator")


@register_kl_estimator("kl", "k1")
def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k1 = x − y: unbiased, high variance, can be negative."""
    return log_prob - ref_log_prob


@register_kl_estimator("abs")
def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """|x − y|."""
    return (log_prob - ref_log_prob).abs()


@register_kl_estimator("mse", "k2")
def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k2 = ½(x − y)²: biased, low variance; its gradient is the on-policy gradient of KL(π ‖ π_ref)."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("low_var_kl", "k3")
def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    r"""k3 = e^u − u − 1 with u = clamp(y − x, −20, 20), then clamped to [−10, 10].

    Unbiased (E_π[e^u] = 1) and always ≥ 0. The clamps keep a single token with a vanishing reference
    probability from dominating the loss.
    """
    u = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
    return torch.clamp(torch.exp(u) - u - 1.0, -10.0, 10.0)


@register_kl_estimator("full")
def kl_full(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    r"""Exact KL(p ‖ q) = Σ_v p_v (log p_v − log q_v) from full log-distributions.

    ``log_prob``, ``ref_log_prob``: (..., V) finite log-probabilities (e.g. log_softmax outputs);
    returns (...).
    """
    if log_prob.shape != ref_log_prob.shape:
        raise ValueError(
            f"'full' KL needs two (..., V) log-distributions of one shape, got "
            f"{tuple(log_prob.shape)} and {tuple(ref_log_prob.shape)}"
        )
    return (log_prob.exp() * (log_prob - ref_log_prob)).sum(-1)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    r"""Per-token KL estimate of the estimator registered as ``kind``.

    A ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``, ``abs+`` …) is the straight-through form: the
    value of the named estimator with the gradient of k2,

    .. math:: \mathrm{sg}[k] + k_2 - \mathrm{sg}[k_2]

    so a KL loss can report (say) the unbiased k3 while optimising with k2's unbiased gradient. ``full+``
    does not exist (k2 needs per-token log-probs, ``full`` whole distributions).
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base not in KL_ESTIMATORS or (straight_through and base == "full"):
        raise ValueError(
            f"unknown KL estimator {kind!r}; known: {', '.join(sorted(KL_ESTIMATORS))}, "
            "and each of them except 'full' with a '+' suffix"
        )
    value = KL_ESTIMATORS[base](log_prob, ref_log_prob)
    if not straight_through:
        return value
    k2 = kl_k2(log_prob, ref_log_prob)
    return value.detach() + (k2 - k2.detach())


def gaussian_kl(mean: Tensor, ref_mean: Tensor, std: Tensor | float, reduce: str = "mean") -> Tensor:
    r"""Closed-form KL between two isotropic Gaussians that share their std, per row.

    .. math:: \mathrm{KL}\big(\mathcal N(\mu, s^2 I)\,\|\,\mathcal N(\mu_{ref}, s^2 I)\big)
              = \sum_j \frac{(\mu_j - \mu_{ref,j})^2}{2 s^2}

    ``mean``, ``ref_mean``: (B, ...); ``std``: a number, or a tensor broadcastable to them (e.g. (B, 1,
    ...)). Returns (B,): the sum over the non-batch elements (``reduce="sum"``, the exact KL of the joint
    distribution) or their mean (``reduce="mean"``, the exact KL divided by the number of elements, on the
    same per-element scale as a mean-reduced log-probability). The KL of one Flow-GRPO denoising step
    (both policies N(μ, (σ_t√h)²I)) is this with s = σ_t√h.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    per_element = (mean - ref_mean).square() / (2.0 * torch.as_tensor(std, dtype=mean.dtype).square())
    flat = per_element.reshape(per_element.shape[0], -1)
    return flat.mean(-1) if reduce == "mean" else flat.sum(-1)


class KLController:
    """The KL coefficient β (``.value``) and its checkpointable state; subclasses define ``update``."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class FixedKLController(KLController):
    """A constant KL coefficient β = ``kl_coef``."""

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Nothing to adapt: β stays ``kl_coef``."""


class AdaptiveKLController(KLController):
    r"""Proportional control of β towards a target KL (Ziegler et al. 2019).

    .. math:: e = \mathrm{clip}(\mathrm{KL}/\mathrm{KL}_{target} - 1, -0.2, 0.2), \qquad
              \beta \leftarrow \beta\,(1 + e \cdot n_{steps} / \text{horizon})

    β grows while the measured KL is above target and shrinks while it is below, by at most 20% per
    ``horizon`` samples.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        super().__init__(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float | Tensor, n_steps: int) -> None:
        """Move β by the clipped proportional error; ``n_steps`` is the number of samples seen."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(
    kind: str, kl_coef: float, target_kl: float | None = None, horizon: int | None = None
) -> KLController:
    """``fixed`` → :class:`FixedKLController`; ``adaptive`` (needs target_kl, horizon) → adaptive."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ValueError("an adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; known: adaptive, fixed")
