"""Pure tensor maths of RL post-training: advantages, losses, KL, masked statistics.

Every function takes tensors and plain numbers and returns tensors (and a metrics dict); families of
interchangeable functions are registered by name in the dicts exported below.
"""

# Registers the further policy-loss modes (geo_mean, sapo, dppo_tv, dppo_kl, gpg, dro) in POLICY_LOSSES.
from tearless.algos import surrogates  # noqa: F401
from tearless.algos.advantages import ADV_ESTIMATORS, compute_advantage, register_adv_estimator
from tearless.algos.aggregation import AGG_MODES, agg_loss, register_agg_mode
from tearless.algos.dapo import filter_groups, overlong_penalty
from tearless.algos.dpo import DPO_LOSSES, F_DIVERGENCES, REFERENCE_FREE, dpo_loss, register_dpo_loss
from tearless.algos.groups import group_ids
from tearless.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    gaussian_kl,
    kl_penalty,
    make_kl_controller,
    register_kl_estimator,
)
from tearless.algos.losses import (
    POLICY_LOSSES,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    register_policy_loss,
    value_loss,
)
from tearless.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten, zero_masked
from tearless.algos.preference import KTO_LOSSES, kto_loss, kto_reference_point, register_kto_loss
from tearless.algos.reward_model import bradley_terry_loss

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "DPO_LOSSES",
    "F_DIVERGENCES",
    "KL_ESTIMATORS",
    "KTO_LOSSES",
    "POLICY_LOSSES",
    "REFERENCE_FREE",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "agg_loss",
    "bradley_terry_loss",
    "compute_advantage",
    "dpo_loss",
    "entropy_from_logits",
    "filter_groups",
    "gaussian_kl",
    "group_ids",
    "kl_penalty",
    "kto_loss",
    "kto_reference_point",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "policy_loss",
    "register_adv_estimator",
    "register_agg_mode",
    "register_dpo_loss",
    "register_kl_estimator",
    "register_kto_loss",
    "register_policy_loss",
    "value_loss",
    "zero_masked",
]
