import math

import pytest
import torch

from tearless.flow.models import MLPVelocity
from tearless.flow.sampler import (
    StepParams,
    gaussian_log_prob,
    guided_velocity,
    sample_ode,
    sample_sde,
    sde_sigma,
    sde_step_mean,
    sigma_schedule,
    step_log_prob,
    step_params,
)
from tests.flow.helpers import GaussianFlow
from tests.tolerances import sum_tol


def test_sigma_schedule_hand_values():
    # shift 3 at s = 0.5: 1.5 / (1 + 2·0.5) = 0.75; at s = 0.25: 0.75 / 1.5 = 0.5.
    assert sigma_schedule(4, 3.0).tolist() == pytest.approx([1.0, 0.9, 0.75, 0.5, 0.0])
    assert sigma_schedule(4).tolist() == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    with pytest.raises(ValueError, match="num_steps"):
        sigma_schedule(0)


def test_sde_sigma_and_the_t_equals_one_case():
    # a·sqrt(t/(1−t)): t = 0.5 → a; t = 1 uses 1 − σ_1 = 1 − 0.75 → 0.7·sqrt(1/0.25) = 1.4.
    assert sde_sigma(0.5, 0.7, 0.75) == pytest.approx(0.7)
    assert sde_sigma(1.0, 0.7, 0.75) == pytest.approx(1.4)
    p = step_params(sigma_schedule(4), 0, 0.7)
    assert (p.t, p.t_next, p.sigma) == pytest.approx((1.0, 0.75, 1.4))
    assert p.std == pytest.approx(1.4 * math.sqrt(0.25))


def test_sde_step_mean_hand_worked_and_euler_at_zero_noise():
    # t = 0.5 → 0.25 (Δt = −0.25), σ_t = 1: μ = x + Δt[v + (1/(2·0.5))(x + 0.5v)] = x − 0.25(1.5v + x).
    x, v = torch.tensor([[2.0]]), torch.tensor([[4.0]])
    assert sde_step_mean(x, v, StepParams(0.5, 0.25, 1.0, 0.5)).item() == pytest.approx(2 - 0.25 * 8)
    assert sde_step_mean(x, v, StepParams(0.5, 0.25, 0.0, 0.0)).item() == pytest.approx(2 - 0.25 * 4)


def test_gaussian_log_prob_hand_worked_mean_and_sum():
    # x − μ = (1, 0), s = 2: per element −1/8 − log 2 − ½log 2π and −log 2 − ½log 2π.
    x, mu = torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2)
    c = -math.log(2.0) - 0.5 * math.log(2 * math.pi)
    assert gaussian_log_prob(x, mu, 2.0, "sum").item() == pytest.approx(2 * c - 0.125)
    assert gaussian_log_prob(x, mu, 2.0).item() == pytest.approx(c - 0.0625)
    with pytest.raises(ValueError, match="std must be > 0"):
        gaussian_log_prob(x, mu, 0.0)


@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_recomputed_log_prob_equals_the_stored_one_exactly(guidance_scale, reduce):
    torch.manual_seed(0)
    model = MLPVelocity(num_prompts=4)
    g = torch.Generator().manual_seed(1)
    cond = torch.arange(4).repeat_interleave(3)
    uncond = torch.full_like(cond, 4)
    sigmas = sigma_schedule(10, 3.0)
    kwargs = {"guidance_scale": guidance_scale, "uncond": uncond, "reduce": reduce}
    traj = sample_sde(model, cond, torch.randn(12, 2, generator=g), sigmas, generator=g, **kwargs)
    assert traj.latents.shape == (12, 11, 2) and traj.log_probs.shape == (12, 10)
    for j in range(10):
        p = step_params(sigmas, j, 0.7)
        log_prob, _ = step_log_prob(model, traj.latents[:, j], traj.latents[:, j + 1], cond, p, **kwargs)
        assert torch.equal(log_prob, traj.log_probs[:, j])


class RecordingFlow(GaussianFlow):
    """The exact flow, noting the dtype each call was fed."""

    def __init__(self):
        super().__init__()
        self.seen: set[torch.dtype] = set()

    def forward(self, x, t, cond):
        self.seen.add(x.dtype)
        return super().forward(x, t, cond)


def test_bfloat16_model_gets_bfloat16_inputs_but_steps_and_log_probs_are_float32():
    model, g = RecordingFlow(), torch.Generator().manual_seed(0)
    sigmas = sigma_schedule(10, 3.0)
    cond = torch.zeros(8)
    noise = torch.randn(8, 4, 16, 16, generator=g).bfloat16()
    traj = sample_sde(model, cond, noise, sigmas, generator=g)
    assert model.seen == {torch.bfloat16} and traj.model_dtype == torch.bfloat16
    assert traj.latents.dtype == torch.float32 and traj.log_probs.dtype == torch.float32
    n = 4 * 16 * 16
    for j in range(10):
        p = step_params(sigmas, j, 0.7)
        x, next_x = traj.latents[:, j], traj.latents[:, j + 1]
        log_prob, _ = step_log_prob(model, x, next_x, cond, p, model_dtype=traj.model_dtype)
        assert torch.equal(log_prob, traj.log_probs[:, j])  # the same float32 expression
        # Against float64 from the same (bfloat16) velocity: a mean of n float32 terms of about 1-3 in
        # size, each a handful of roundings (n + 8 terms' worth), instead of bfloat16's 2⁻⁸ per term.
        v = guided_velocity(model, x.bfloat16(), p.t, cond).double()
        mean64 = sde_step_mean(x.double(), v, p)
        exact = gaussian_log_prob(next_x.double(), mean64, p.std)
        terms = ((next_x.double() - mean64) ** 2 / (2 * p.std**2) + abs(math.log(p.std)) + 1).mean()
        atol = sum_tol(n + 8, float(terms))
        torch.testing.assert_close(traj.log_probs[:, j].double(), exact, atol=atol, rtol=0)
        # The bfloat16 evaluation this replaced misses by more than that tolerance.
        old = gaussian_log_prob(next_x.bfloat16(), sde_step_mean(x.bfloat16(), v.bfloat16(), p), p.std)
        assert (old.double() - exact).abs().max() > atol


def test_sde_preserves_the_marginals_of_an_exact_flow():
    # The exact velocity of N(1, 0.5²) data: both the ODE and the SDE (a = 0.7, 50 steps) land on it.
    flow, g = GaussianFlow(m=1.0, s=0.5), torch.Generator().manual_seed(0)
    noise, cond = torch.randn(20000, 2, generator=g), torch.zeros(20000)
    sde = sample_sde(flow, cond, noise, sigma_schedule(50), noise_level=0.7, generator=g).samples
    ode = sample_ode(flow, cond, noise, sigma_schedule(50))
    for x in (sde, ode):
        assert x.mean().item() == pytest.approx(1.0, abs=0.02)
        assert x.std().item() == pytest.approx(0.5, abs=0.02)
    # Noise level 0 makes the SDE the Euler ODE: same draws, same samples.
    zero = sample_sde(flow, cond, noise, sigma_schedule(50), noise_level=1e-12, generator=g).samples
    # Not bit for bit: the SDE's step adds its (1e-12-sized) corrections in another order. 50 steps
    # of about 10 float32 operations each (velocity, step) on values the size of the samples.
    atol = sum_tol(50 * 10, float(ode.abs().max()))
    torch.testing.assert_close(zero, ode, atol=atol, rtol=0)


def test_cfg_on_and_off():
    # GaussianFlow's cond shifts the data mean: cond 1 → N(2, ·), null cond 0 → N(1, ·).
    flow = GaussianFlow(m=1.0, s=0.5)
    x, cond, null = torch.randn(5, 2), torch.ones(5), torch.zeros(5)
    tt = torch.full((5,), 0.6)
    v_c, v_u = flow(x, tt, cond), flow(x, tt, null)
    assert torch.equal(guided_velocity(flow, x, 0.6, cond), v_c)
    assert torch.equal(guided_velocity(flow, x, 0.6, cond, guidance_scale=1.0, uncond=null), v_c)
    assert torch.allclose(
        guided_velocity(flow, x, 0.6, cond, guidance_scale=3.0, uncond=null), v_u + 3 * (v_c - v_u)
    )
    # The field is affine in the data mean, so guidance w samples the mean m_u + w(m_c − m_u) = 1 + 2·1.
    noise = torch.randn(4000, 2, generator=torch.Generator().manual_seed(0))
    ones, zeros = torch.ones(4000), torch.zeros(4000)
    plain = sample_ode(flow, ones, noise, sigma_schedule(40))
    guided = sample_ode(flow, ones, noise, sigma_schedule(40), guidance_scale=2.0, uncond=zeros)
    assert plain.mean().item() == pytest.approx(2.0, abs=0.03)
    assert guided.mean().item() == pytest.approx(3.0, abs=0.03)


def test_cfg_gradient_flows_only_through_the_conditional_branch():
    torch.manual_seed(0)
    model = MLPVelocity(num_prompts=2)
    x, cond, null = torch.randn(3, 2), torch.tensor([0, 1, 0]), torch.full((3,), 2)
    w = 4.0
    guided_velocity(model, x, 0.5, cond, guidance_scale=w, uncond=null).sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (w * model(x, torch.full((3,), 0.5), cond)).sum().backward()
    # Exactly: the same forward of the same rows, and the same upstream gradient w·1 into v_c (the
    # unconditional branch has none), so the same backward.
    for a, p in zip(got, model.parameters(), strict=True):
        assert torch.equal(a, p.grad)
