r"""Advantage estimators, registered by name in :data:`ADV_ESTIMATORS`.

Notation (shared by every docstring below): row i of a (B, T) batch, token t; :math:`m_{i,t}` is
``response_mask``; :math:`r_{i,t}` is ``token_level_rewards`` (a rule reward is one nonzero value on the
last valid token); :math:`R_i = \sum_t r_{i,t} m_{i,t}` is the outcome reward; :math:`g(i)` is the group
of row i (rows with the same ``index`` id, i.e. the responses to one prompt) and :math:`n_g` its size.

Every estimator returns ``(advantages, returns)``, both (B, T) and both exactly 0 where the mask is 0.
Outcome estimators broadcast a per-row scalar to the row's valid tokens. Each docstring says what a
group whose rewards are all equal receives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tearless.algos._registry import call_accepted, lookup, registrar
from tearless.algos.groups import GroupIndex, group_ids, group_reduce, group_sizes
from tearless.algos.masked import masked_sum, masked_whiten, zero_masked

ADV_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {}
register_adv_estimator = registrar(ADV_ESTIMATORS, "advantage estimator")


@torch.no_grad()
def compute_advantage(
    estimator: str,
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    reward_baselines: Tensor | None = None,
    std_scope: str = "group",
    unbiased_std: bool = True,
    step_mask: Tensor | None = None,
    teacher_log_prob: Tensor | None = None,
    student_log_prob: Tensor | None = None,
    distill_reward_coef: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns, both (B, T), from the estimator registered as ``estimator``.

    ``index`` is the group id of each row (a sequence of hashables or a 1-D tensor); rows are grouped
    by equal ids wherever they sit in the batch. Each estimator receives only the inputs its signature
    names; one it needs that is None (``values`` for ``gae``, ``index`` for group estimators,
    ``reward_baselines`` for ``remax``) raises ValueError naming it. The whitened estimators (``gae``,
    ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``) need at least two valid tokens in the
    batch. ``std_scope`` (``grpo`` only) is ``group`` (each group's std, the default) or ``batch`` (one
    std over every row's outcome reward, as Flow-GRPO's ``global_std``); ``unbiased_std`` (``grpo``
    only) divides the variance by n − 1 (``torch.std``, veRL) or, when False, by n (numpy's default,
    Flow-GRPO). ``step_mask`` (B, T) marks the last token of each reasoning step (``grpo_process``
    only; see :mod:`tearless.rewards.steps`). ``teacher_log_prob`` and ``student_log_prob`` (B, T) are
    the sampled tokens' log-probs under the teacher and the student that sampled them, and
    ``distill_reward_coef`` weighs the task reward (``on_policy_distill`` only). Runs without
    autograd: advantages are constants for the policy update.
    """
    fn = lookup(ADV_ESTIMATORS, estimator, "advantage estimator")
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            "token_level_rewards and response_mask must both be (B, T), got "
            f"{tuple(token_level_rewards.shape)} and {tuple(response_mask.shape)}"
        )
    extras = (
        ("values", values),
        ("step_mask", step_mask),
        ("teacher_log_prob", teacher_log_prob),
        ("student_log_prob", student_log_prob),
    )
    for name, extra in extras:
        if extra is not None and extra.shape != response_mask.shape:
            raise ValueError(
                f"{name} must be (B, T) = {tuple(response_mask.shape)}, got {tuple(extra.shape)}"
            )
    inputs = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask.bool(),
        "index": index,
        "values": values,
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        "epsilon": epsilon,
        "reward_baselines": reward_baselines,
        "std_scope": std_scope,
        "unbiased_std": unbiased_std,
        "step_mask": step_mask,
        "teacher_log_prob": teacher_log_prob,
        "student_log_prob": student_log_prob,
        "distill_reward_coef": distill_reward_coef,
    }
    return call_accepted(fn, inputs, f"advantage estimator {estimator!r}")


def _outcome(token_level_rewards: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(token_level_rewards, mask, dim=-1)


def _tile(per_row: Tensor, mask: Tensor) -> Tensor:
    return zero_masked(per_row.unsqueeze(-1).expand(mask.shape), mask)


def _centred(rewards: Tensor, ids: Tensor) -> Tensor:
    """R_i minus its group mean, exactly 0 for a group of equal rewards (and for a singleton).

    Shifting by the group maximum before averaging makes the equal-reward case exact: three rewards of
    0.1 would otherwise leave a mean of 0.10000000000000002 and a nonzero advantage.
    """
    shifted = rewards - group_reduce(rewards, ids, "amax")[ids]
    mean = group_reduce(shifted, ids) / torch.bincount(ids).to(rewards.dtype)
    return shifted - mean[ids]


def _group_std(centred: Tensor, ids: Tensor, sizes: Tensor, unbiased: bool = True) -> Tensor:
    """Std of each row's group, (B,): unbiased (÷ n − 1) or population (÷ n); 1 for a singleton
    (nothing to estimate it from)."""
    var = group_reduce(centred.square(), ids)[ids] / ((sizes - 1).clamp(min=1) if unbiased else sizes)
    return torch.where(sizes > 1, var.sqrt(), torch.ones_like(var))


def _gae_scan(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """Unwhitened GAE, (B, T), by a reverse scan that skips masked tokens.

    A masked token is not a step of the trajectory (padding, or a tool's output in a multi-turn
    rollout): the next value and the running advantage are carried across it unchanged, so the reward
    of the last turn reaches the tokens of earlier turns.
    """
    rewards, values = zero_masked(rewards, mask), zero_masked(values, mask)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(next_value)
    columns = []
    for t in reversed(range(rewards.shape[-1])):
        valid = mask[:, t]
        candidate = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * running
        next_value = torch.where(valid, values[:, t], next_value)
        running = torch.where(valid, candidate, running)
        columns.append(running)
    return zero_masked(torch.stack(columns[::-1], dim=-1), mask)


def _discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    # G_t = r_t + γ G_{t+1} is GAE with V ≡ 0 and λ = 1, masked tokens skipped the same way.
    return _gae_scan(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)


@register_adv_estimator("gae")
def gae_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, values: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    r"""Generalised advantage estimation (Schulman et al. 2016) with a critic.

    Reverse scan over valid tokens only (masked tokens are skipped, carrying :math:`V_{next}` and
    :math:`A_{next}` across them):

    .. math:: \delta_t = r_t + \gamma V_{next} - V_t, \qquad A_t = \delta_t + \gamma\lambda A_{next}

    returns = A + V (before whitening); advantages = masked_whiten(A) over every valid token of the
    batch. With γ = λ = 1, A_t is the Monte-Carlo return minus :math:`V_t`. No groups: equal rewards
    mean nothing special here.
    """
    raw = _gae_scan(token_level_rewards, values, response_mask, gamma, lam)
    returns = zero_masked(raw + values, response_mask)
    return masked_whiten(raw, response_mask), returns


@register_adv_estimator("grpo")
def grpo_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    norm_adv_by_std_in_grpo: bool,
    epsilon: float,
    std_scope: str = "group",
    unbiased_std: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""GRPO (Shao et al. 2024): group-normalised outcome reward.

    .. math:: A_i = \frac{R_i - \mu_{g(i)}}{\sigma_{g(i)} + \epsilon} \quad
              (\text{or } R_i - \mu_{g(i)} \text{ when not norm\_adv\_by\_std\_in\_grpo: Dr. GRPO})

    σ is the unbiased std of the group (``std_scope="group"``), or, with ``std_scope="batch"``, the
    unbiased std of all B outcome rewards (Flow-GRPO's ``global_std``, which keeps a near-uniform group
    from having its tiny differences blown up to ±1; a batch of one row gets σ = 1). A group of one has
    μ = 0 and, with group scope, σ = 1, so its row keeps :math:`R_i/(1+\epsilon)` (veRL's convention).
    ``unbiased_std=False`` takes the population std instead (÷ n, Flow-GRPO's numpy ``std``). Equal
    rewards in a group give exactly 0. returns = advantages.
    """
    if std_scope not in ("group", "batch"):
        raise ValueError(f"std_scope must be 'group' or 'batch', got {std_scope!r}")
    rewards = _outcome(token_level_rewards, response_mask)
    ids = group_ids(index, rewards.shape[0], rewards.device)
    sizes = group_sizes(ids, rewards.dtype)
    centred = _centred(rewards, ids)
    adv = torch.where(sizes > 1, centred, rewards)
    if norm_adv_by_std_in_grpo:
        if std_scope == "group":
            std = _group_std(centred, ids, sizes, unbiased_std)
        elif rewards.numel() > 1:
            std = rewards.std(correction=1 if unbiased_std else 0)
        else:
            std = torch.ones_like(rewards[0])
        adv = adv / (std + epsilon)
    adv = _tile(adv, response_mask)
    return adv, adv


@register_adv_estimator("rloo")
def rloo_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex
) -> tuple[Tensor, Tensor]:
    r"""REINFORCE leave-one-out (Ahmadian et al. 2024): the baseline is the mean of the other samples.

    .. math:: A_i = R_i - \frac{1}{n_g - 1}\sum_{j \ne i} R_j = \frac{n_g}{n_g - 1}(R_i - \mu_{g(i)})

    A group of one gets 0: it has no other sample to form a baseline from, and keeping the raw reward
    (as veRL's loop version does) would silently mix an un-baselined REINFORCE term into the batch.
    Equal rewards in a group give exactly 0. returns = advantages.
    """
    rewards = _outcome(token_level_rewards, response_mask)
    ids = group_ids(index, rewards.shape[0], rewards.device)
    sizes = group_sizes(ids, rewards.dtype)
    adv = _centred(rewards, ids) * sizes / (sizes - 1).clamp(min=1)
    adv = _tile(torch.where(sizes > 1, adv, torch.zeros_like(adv)), response_mask)
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, gamma: float
) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++ (Hu 2025): discounted return whitened over the batch (a global baseline).

    .. math:: G_t = r_t + \gamma G_{t+1}, \qquad A = \mathrm{masked\_whiten}(G)

    The return runs over valid tokens only: a masked token (padding, or a tool's output in a multi-turn
    rollout) is skipped, its reward not added and the running return carried across it unchanged, so
    the reward of the last turn reaches earlier turns; veRL 0.9 does the same. There are no groups: a
    group of equal rewards gets the batch-relative value (R − μ_batch)/σ_batch, not 0. returns = G.
    """
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@register_adv_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex
) -> tuple[Tensor, Tensor]:
    r"""REINFORCE++ with a group-mean baseline, then whitened over the batch.

    .. math:: A_{i,t} = \mathrm{masked\_whiten}\big(R_i - \mu_{g(i)}\big)

    The per-row value is tiled over the row's valid tokens before whitening, so μ_batch and σ_batch are
    token-weighted. A group of one has μ = 0. A group of equal rewards is 0 before whitening and
    −μ_batch/σ_batch after it. returns = advantages.
    """
    rewards = _outcome(token_level_rewards, response_mask)
    ids = group_ids(index, rewards.shape[0], rewards.device)
    adv = torch.where(group_sizes(ids, rewards.dtype) > 1, _centred(rewards, ids), rewards)
    adv = masked_whiten(_tile(adv, response_mask), response_mask)
    return adv, adv


@register_adv_estimator("gpg")
def gpg_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex
) -> tuple[Tensor, Tensor]:
    r"""GPG's corrected group advantage (Chu et al. 2025), for ``loss_mode=gpg``.

    .. math:: A_i = \alpha\,(R_i - \mu_{g(i)}), \qquad \alpha = \frac{B}{\max(1, |\{j : R_j \ne 0\}|)}

    over the B rows of the batch: α scales the batch's gradient up by how few rows carry a reward.
    That is veRL 0.9's ``compute_gpg_outcome_advantage`` (no std division), followed here; the paper
    bases α on the rows of groups whose rewards are all equal (they carry no signal), veRL's code on
    the rows with a zero reward. A group of one has μ = 0 (its row keeps αR_i, as veRL). Equal rewards
    in a group give exactly 0. returns = advantages.
    """
    rewards = _outcome(token_level_rewards, response_mask)
    ids = group_ids(index, rewards.shape[0], rewards.device)
    alpha = rewards.shape[0] / (rewards != 0).sum().clamp(min=1).to(rewards.dtype)
    adv = torch.where(group_sizes(ids, rewards.dtype) > 1, _centred(rewards, ids), rewards)
    adv = _tile(alpha * adv, response_mask)
    return adv, adv


@register_adv_estimator("remax")
def remax_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, reward_baselines: Tensor
) -> tuple[Tensor, Tensor]:
    r"""ReMax (Li et al. 2023): the baseline is the reward of the greedy response to the same prompt.

    .. math:: G_{i,t} = \sum_{t' \ge t} r_{i,t'} m_{i,t'}, \qquad A_{i,t} = G_{i,t} - b_i

    ``reward_baselines`` is b, shape (B,). Not grouped: a sample whose reward equals its greedy
    baseline gets 0 on its last token (and 0 everywhere for an outcome reward). returns = G.
    """
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines must be (B,) = ({token_level_rewards.shape[0]},), "
            f"got {tuple(reward_baselines.shape)}"
        )
    returns = _discounted_returns(token_level_rewards, response_mask, 1.0)
    adv = zero_masked(returns - reward_baselines.to(returns.dtype).unsqueeze(-1), response_mask)
    return adv, returns


@register_adv_estimator("opo")
def opo_advantage(
    *, token_level_rewards: Tensor, response_mask: Tensor, index: GroupIndex
) -> tuple[Tensor, Tensor]:
    r"""On-policy RL with an optimal baseline (OPO, Hao et al. 2025): a length-weighted group baseline.

    .. math:: b_g = \frac{\sum_{j \in g} L_j R_j}{\sum_{j \in g} L_j}, \qquad A_i = R_i - b_{g(i)}

    L is the number of valid tokens of a row. A group of one has b = 0 (its row keeps R_i). Equal
    rewards in a group give exactly 0. returns = advantages.
    """
    rewards = _outcome(token_level_rewards, response_mask)
    ids = group_ids(index, rewards.shape[0], rewards.device)
    lengths = response_mask.sum(-1).to(rewards.dtype)
    # Shifted by the group max for the same exactness as _centred; the baseline is shift-equivariant.
    shifted = rewards - group_reduce(rewards, ids, "amax")[ids]
    baseline = group_reduce(lengths * shifted, ids) / group_reduce(lengths, ids).clamp(min=1)
    adv = torch.where(group_sizes(ids, rewards.dtype) > 1, shifted - baseline[ids], rewards)
    adv = _tile(adv, response_mask)
    return adv, adv


@register_adv_estimator("grpo_passk")
def grpo_passk_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    norm_adv_by_std_in_grpo: bool,
    epsilon: float,
) -> tuple[Tensor, Tensor]:
    r"""Pass@k training (Chen et al. 2025): only the best response of each group is credited.

    .. math:: A_i = \begin{cases} \frac{R_{(1)} - R_{(2)}}{\sigma_g + \epsilon} &
              i = \arg\max_{j \in g} R_j \\ 0 & \text{otherwise} \end{cases}

    :math:`R_{(1)}, R_{(2)}` are the largest and second largest rewards of the group; the arg max is
    the first row in batch order on ties (where the gap is 0 anyway); σ is the unbiased group std, and
    the division is skipped when not ``norm_adv_by_std_in_grpo``. Every group needs at least two rows
    (ValueError otherwise). Equal rewards in a group give 0. returns = advantages.
    """
    rewards = _outcome(token_level_rewards, response_mask)
    ids = group_ids(index, rewards.shape[0], rewards.device)
    sizes = group_sizes(ids, rewards.dtype)
    if bool((sizes < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses in every group")
    best = group_reduce(rewards, ids, "amax")
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    first_best = group_reduce(torch.where(rewards == best[ids], rows, rows.numel()), ids, "amin")
    is_winner = rows == first_best[ids]
    second = group_reduce(torch.where(is_winner, -torch.inf, rewards), ids, "amax")
    gap = (best - second)[ids]
    if norm_adv_by_std_in_grpo:
        gap = gap / (_group_std(_centred(rewards, ids), ids, sizes) + epsilon)
    adv = _tile(torch.where(is_winner, gap, torch.zeros_like(gap)), response_mask)
    return adv, adv


@register_adv_estimator("grpo_process")
def grpo_process_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: GroupIndex,
    step_mask: Tensor,
    norm_adv_by_std_in_grpo: bool,
    epsilon: float,
) -> tuple[Tensor, Tensor]:
    r"""Process-supervised GRPO (Shao et al. 2024, DeepSeekMath §4.1.3): step rewards normalised over
    the group, each token credited with the steps from its own onward.

    With :math:`r_{i,j}` the reward of step j of row i (``token_level_rewards`` at the step's last
    token, where ``step_mask`` is 1) and :math:`\mathcal{R}_g` every step reward of group g:

    .. math:: \tilde r_{i,j} = \frac{r_{i,j} - \operatorname{mean}(\mathcal{R}_{g(i)})}
              {\operatorname{std}(\mathcal{R}_{g(i)}) + \epsilon}, \qquad
              A_{i,t} = \sum_{j:\ \mathrm{end}(j) \ge t} \tilde r_{i,j}

    std is unbiased over the group's steps (1 for a group with a single step; the division is skipped
    when not ``norm_adv_by_std_in_grpo``). Rewards off the step positions are ignored, so an outcome
    reward counts only where it shares the last step's token (see
    :func:`tearless.rewards.steps.token_level_rewards`). A group whose step rewards are all equal gets
    exactly 0; so does a row without steps after its last step. returns = advantages.
    """
    steps = step_mask.bool() & response_mask
    ids = group_ids(index, token_level_rewards.shape[0], token_level_rewards.device)
    dtype = token_level_rewards.dtype
    counts = group_reduce(steps.sum(-1).to(dtype), ids)
    # Shifted by the group's largest step reward, as _centred, so equal rewards centre to exactly 0.
    row_max = torch.where(steps, token_level_rewards, -torch.inf).amax(-1)
    top = group_reduce(row_max, ids, "amax")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    shifted = torch.where(steps, token_level_rewards - top[ids].unsqueeze(-1), 0.0)
    mean = group_reduce(shifted.sum(-1), ids) / counts.clamp(min=1)
    centred = torch.where(steps, shifted - mean[ids].unsqueeze(-1), 0.0)
    if norm_adv_by_std_in_grpo:
        var = group_reduce(centred.square().sum(-1), ids) / (counts - 1).clamp(min=1)
        std = torch.where(counts > 1, var.sqrt(), torch.ones_like(var))
        centred = centred / (std[ids].unsqueeze(-1) + epsilon)
    adv = zero_masked(centred.flip(-1).cumsum(-1).flip(-1), response_mask)
    return adv, adv


@register_adv_estimator("on_policy_distill")
def on_policy_distill_advantage(
    *,
    token_level_rewards: Tensor,
    response_mask: Tensor,
    teacher_log_prob: Tensor,
    student_log_prob: Tensor,
    index: GroupIndex | None = None,
    distill_reward_coef: float = 0.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    r"""On-policy distillation (Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025): each sampled
    token is credited with how much more likely the teacher finds it than the student did, optionally
    plus α times the GRPO advantage of the task reward.

    .. math:: A_{i,t} = m_{i,t}\left[\log \pi_T(y_{i,t} \mid y_{i,<t}) - \log \pi_S(y_{i,t} \mid
              y_{i,<t}) + \alpha \, A^{\mathrm{GRPO}}_i\right]

    The first term is the negative of the one-sample estimate of the per-token reverse KL
    :math:`\mathrm{KL}(\pi_S \Vert \pi_T)` at the student's own states, a dense reward with no
    discount (γ = 0: a token is credited only with its own KL, not its successors', as Tinker's
    recipe). It is an advantage, not a loss, so every policy-loss mode (PPO clip, GSPO, CISPO, …), every
    aggregation mode and the ratio to :math:`\pi_{old}` apply unchanged, and its gradient is the
    policy gradient of the reverse KL. :math:`A^{\mathrm{GRPO}}` is :func:`grpo_advantage` of the
    outcome reward over the ``index`` groups (needed only when α ≠ 0; α = 0 is pure distillation). A
    student equal to its teacher gets exactly α·A^GRPO; a group of equal rewards adds 0. returns =
    advantages.
    """
    adv = teacher_log_prob - student_log_prob
    if distill_reward_coef:
        if index is None:
            raise ValueError("on_policy_distill with distill_reward_coef != 0 needs 'index'")
        task, _ = grpo_advantage(
            token_level_rewards=token_level_rewards,
            response_mask=response_mask,
            index=index,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
            epsilon=epsilon,
        )
        adv = adv + distill_reward_coef * task
    adv = zero_masked(adv, response_mask)
    return adv, adv
