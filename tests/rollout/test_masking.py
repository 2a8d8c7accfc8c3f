"""Tool output is context, never a training target: the policy loss (with its KL and entropy terms)
has exactly zero gradient at tool positions, tool tokens reach the loss only through the context, every
advantage estimator treats a hole in the mask as if the tool tokens were not there, and the score
sits on the last model token."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tearless.algos import compute_advantage
from tearless.config.schema import ActorConfig
from tearless.models.logprobs import response_logprobs
from tearless.rewards.steps import score_positions
from tearless.tasks.bootstrap import tiny_llama
from tearless.workers.actor import Actor
from tearless.workers.schedule import UpdateFlags, UpdateSettings
from tests.tolerances import sum_tol

VOCAB, PAD = 40, 0
# Two trajectories of 12 response tokens: model (1) and tool (0) tokens, then padding (attention 0).
MASK = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0]])
ATTENTION = torch.tensor([[1] * 12, [1] * 9 + [0] * 3])


def batch(seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    response = torch.randint(1, VOCAB, (2, 12), generator=g) * ATTENTION
    return TensorDict(
        {
            "prompt_ids": torch.tensor([[PAD, 5, 6, 7], [8, 9, 10, 11]]),
            "prompt_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]),
            "response_ids": response,
            "response_mask": MASK,
            "response_attention_mask": ATTENTION,
            "advantages": torch.tensor([[1.5] * 12, [-0.7] * 12]) * MASK,
            "old_log_prob": torch.full((2, 12), -3.0) * MASK,
            "ref_log_prob": torch.full((2, 12), -3.5) * MASK,
        },
        batch_size=[2],
    )


@pytest.fixture(scope="module")
def model():
    return tiny_llama(
        VOCAB, hidden_size=32, num_layers=1, pad_token_id=PAD, eos_token_id=1, bos_token_id=2, seed=0
    )


def actor_loss_and_logit_grad(model, td, agg: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The actor's micro-batch loss (PPO clip + k3 KL loss + entropy bonus) and its gradient with
    respect to the logits that predict each response token, (B, R, V)."""
    cfg = ActorConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01, loss_agg_mode=agg)
    settings = UpdateSettings.of_section(cfg, 1, "actor", float(td["response_mask"].shape[1]))
    actor = Actor(model, cfg, settings=settings, temperature=1.0, total_steps=1)
    captured = []

    def keep(_module, _inputs, output):
        output.retain_grad()
        captured.append(output)

    handle = model.lm_head.register_forward_hook(keep)
    try:
        mask = td["response_mask"]
        norm = {
            "global_num_tokens": mask.sum(),
            "global_num_seqs": torch.tensor(2),
            "loss_scale_factor": float(mask.shape[1]),
        }
        loss, _ = actor.micro_loss(td, norm, UpdateFlags(detached=False))
        model.zero_grad()
        loss.backward()
    finally:
        handle.remove()
    # Two passes: the prompts' (its last position predicts response token 0), then the responses'
    # (one bucket here: position t predicts token t + 1, up to the last attended column).
    prompt_pass, response_pass = captured
    grad = torch.cat([prompt_pass.grad[:, -1:], response_pass.grad], dim=1)
    return loss.detach(), torch.nn.functional.pad(grad, (0, 0, 0, mask.shape[1] - grad.shape[1]))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_loss_gradient_is_exactly_zero_at_tool_positions_and_not_at_model_positions(model, agg):
    loss, grad = actor_loss_and_logit_grad(model, batch(), agg)
    per_position = grad.abs().sum(-1)
    assert torch.isfinite(loss)
    assert (per_position[MASK == 0] == 0).all()  # exactly, not approximately
    assert (per_position[MASK == 1] > 0).all()


def test_tool_tokens_change_the_loss_only_through_the_context(model):
    a = batch()
    b = batch()
    tool = (ATTENTION == 1) & (MASK == 0)
    b["response_ids"] = torch.where(tool, (a["response_ids"] + 7) % (VOCAB - 1) + 1, a["response_ids"])
    assert not torch.equal(a["response_ids"], b["response_ids"])
    with torch.no_grad():
        lp_a, _ = response_logprobs(model, a["prompt_ids"], a["prompt_mask"], a["response_ids"], ATTENTION)
        lp_b, _ = response_logprobs(model, b["prompt_ids"], b["prompt_mask"], b["response_ids"], ATTENTION)
    # Model tokens before the first tool token see the same context: identical log-probs, exactly (same
    # shapes, so the same kernels; causal attention gives later positions weight exactly 0).
    before = torch.tensor([[1] * 2 + [0] * 10, [1] * 3 + [0] * 9]).bool()
    assert torch.equal(lp_a[before], lp_b[before])
    # Model tokens after it read different tool output: their log-probs (and so the loss) move.
    after = (MASK == 1) & ~before
    assert not torch.allclose(lp_a[after], lp_b[after])
    # …and that is the only way in: the loss is a function of the model tokens' log-probs alone.
    # Splicing a's model-token log-probs into b's tensor (b's values kept at tool positions) gives a's loss.
    from tearless.algos import policy_loss

    def loss_of(lp):
        return policy_loss(
            "vanilla",
            old_log_prob=a["old_log_prob"],
            log_prob=lp,
            advantages=a["advantages"],
            response_mask=MASK,
        )[0]

    spliced = torch.where(MASK == 1, lp_a, lp_b + 5.0)
    assert loss_of(spliced) == loss_of(lp_a)  # exactly: masked entries are zeroed before any arithmetic
    assert loss_of(lp_b) != loss_of(lp_a)


ESTIMATORS = ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo", "gae", "remax"]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_advantages_with_holes_equal_those_of_the_sequence_without_the_tool_tokens(estimator):
    g = torch.Generator().manual_seed(1)
    rows, width = 4, 12
    holed = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
            [1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ]
    )
    compact = torch.zeros_like(holed)
    for i, n in enumerate(holed.sum(-1).tolist()):
        compact[i, :n] = 1
    scores = torch.tensor([1.0, 0.0, 0.5, 1.0])
    values_compact = torch.randn(rows, width, generator=g) * compact

    def lay_out(mask, per_token_compact):
        out = torch.zeros(rows, width)
        out[mask.bool()] = per_token_compact[compact.bool()]
        return out

    def run(mask):
        rewards = torch.zeros(rows, width)
        rewards[torch.arange(rows), score_positions(mask)] = scores
        kwargs = dict(
            token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b", "b"], gamma=0.9, lam=0.8
        )
        if estimator == "gae":
            kwargs["values"] = lay_out(mask, values_compact)
        if estimator == "remax":
            kwargs["reward_baselines"] = torch.tensor([0.5, 0.5, 0.2, 0.2])
        return compute_advantage(estimator, **kwargs)

    adv_h, ret_h = run(holed)
    adv_c, ret_c = run(compact)
    # The same numbers at other positions, so the whitening's mean and std (sums over the batch's
    # 4 × 12 entries, zeros in between) group them differently: float32 sums of 48 terms of size ≤ 3
    # (scores ≤ 1, randn values), and the division by a std of 0.3 or more makes that at most 10.
    atol = sum_tol(rows * width, 10.0)
    torch.testing.assert_close(adv_h[holed.bool()], adv_c[compact.bool()], atol=atol, rtol=0)
    torch.testing.assert_close(ret_h[holed.bool()], ret_c[compact.bool()], atol=atol, rtol=0)
    assert (adv_h[holed == 0] == 0).all()


def test_the_score_goes_on_the_last_model_token_not_on_mask_sum_minus_one():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 1]])
    assert score_positions(mask).tolist() == [4, 2, 0, 5]
