"""The DPO trainer: its batch loss against ``dpo_loss`` on log-probs computed by hand, reference
log-probs computed once, a short run that learns, resume, the command line, and the embedded pairs."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tearless.algos import DPO_LOSSES, dpo_loss, kto_loss, kto_reference_point
from tearless.cli import main
from tearless.config import load_config
from tearless.config.dpo import DPOConfig
from tearless.data.pairs import PairDataset, UnpairedDataset, side_lengths
from tearless.run.tracking import read_metrics
from tearless.tasks import arithmetic
from tearless.trainers.dpo import DPOTrainer, preference_step, reference_logps
from tearless.trainers.kto import kto_step
from tests.tolerances import gradient_terms, logprob_tol, sum_tol

from .tiny import save_tiny_model

DPO_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A policy and a different reference model (two seeds), and a file of pairs.

    The tiny random models cannot generalise from 24 pairs, so validation runs on the training
    pairs here; held-out preference accuracy on the embedded task is measured by the benchmark."""
    root = tmp_path_factory.mktemp("tiny-dpo")
    policy, ref = save_tiny_model(root / "policy", seed=0), save_tiny_model(root / "ref", seed=1)
    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b - 10)}
        for a, b in [(a, 9 - a % 7) for a in range(11, 35)]
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return policy, ref, root


def sequence_logp_tol(model, items) -> float:
    """A response's summed log-prob from two differently batched forwards (the trainer's padded
    micro-batches, or one plain forward per sequence): each token's log-prob agrees to logprob_tol
    (random-init model: logits below 1, init std 0.02 over 32 hidden units), and a response sums
    at most this many of them."""
    tokens = max(max(sum(it["chosen_mask"]), sum(it["rejected_mask"])) for it in items)
    return tokens * logprob_tol(model.config, logit_bound=1.0)


def hand_logp(model, ids: list[int], mask: list[int]) -> float:
    """Σ_t m_t log π(x_t | x_<t) of one unpadded sequence, straight from the logits."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    logps = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return float((logps * torch.tensor(mask[1:])).sum())


SMOOTHING = {"cdpo": 0.2, "robust": 0.2, "exo_pair": 1e-3, "aot": 0.1, "cpo": 0.1, "simpo": 0.1}


@pytest.mark.parametrize("kind", sorted(DPO_LOSSES))
def test_batch_loss_equals_dpo_loss_on_hand_computed_logprobs(dirs, kind):
    from tearless.models.loading import load_causal_lm, load_tokenizer

    smoothing = SMOOTHING.get(kind, 0.0)
    tok, model = load_tokenizer(dirs[0]), load_causal_lm(dirs[0])
    rows = [
        {"prompt": "12+9=", "chosen": "21", "rejected": "11"},
        {"prompt": "5+5=", "chosen": "10", "rejected": "100"},
        {"prompt": "40+2=", "chosen": "42", "rejected": "4"},
    ]
    items = [PairDataset(rows, tok)[i] for i in range(3)]
    ref = {0: (-9.0, -8.0), 1: (-7.5, -12.0), 2: (-6.0, -5.0)}  # any numbers: stored, not recomputed
    pc = torch.tensor([hand_logp(model, it["chosen_ids"], it["chosen_mask"]) for it in items])
    pr = torch.tensor([hand_logp(model, it["rejected_ids"], it["rejected_mask"]) for it in items])
    rc, rr = torch.tensor([ref[i][0] for i in range(3)]), torch.tensor([ref[i][1] for i in range(3)])
    # Responses plus <|end|>: (3, 3), (3, 4), (3, 2) tokens.
    lengths = {"chosen_lengths": torch.tensor([3, 3, 3]), "rejected_lengths": torch.tensor([3, 4, 2])}
    assert side_lengths(items, "rejected").tolist() == [3, 4, 2]
    kw = dict(beta=0.5, label_smoothing=smoothing, kind=kind)
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, **kw, **lengths)
    micro = None if kind.startswith("aot") else 2  # aot sorts the whole step's pairs
    got = preference_step(
        model, items, ref, pad_token_id=tok.pad_token_id, micro_batch_size=micro, train=False, **kw
    )
    # Log-probs of responses agree to delta (sequence_logp_tol); the loss moves by at most its
    # slope with respect to them (autograd at the hand values) times delta, a reward by β·delta
    # (β·delta/L for the per-token rewards of simpo and orpo).
    delta = sequence_logp_tol(model, items)
    pc_, pr_ = pc.clone().requires_grad_(), pr.clone().requires_grad_()
    slopes = torch.autograd.grad(
        dpo_loss(pc_, pr_, rc, rr, **kw, **lengths)[0], (pc_, pr_), allow_unused=True
    )
    loss_tol = delta * sum(float(g.abs().sum()) for g in slopes if g is not None)
    assert got["loss"] == pytest.approx(loss.item(), abs=loss_tol)
    assert got["rewards/chosen"] == pytest.approx(chosen.mean().item(), abs=0.5 * delta)
    assert got["rewards/margins"] == pytest.approx((chosen - rejected).mean().item(), abs=2 * 0.5 * delta)
    assert got["rewards/accuracies"] == pytest.approx((chosen > rejected).float().mean().item())
    assert got["logps/rejected"] == pytest.approx(pr.mean().item(), abs=delta)


@pytest.mark.parametrize("kind", ["sigmoid", "orpo", "kto"])
def test_micro_batching_leaves_the_gradient_unchanged(dirs, kind):
    # orpo's NLL is a token mean over the step's chosen responses (of 2 and 3 tokens here), and kto's
    # reference point z a mean over the step's KL sequences: both stay whole-step quantities.
    from tearless.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(dirs[0])
    rows = [{"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a)} for a in range(5, 10)]
    data = (UnpairedDataset if kind == "kto" else PairDataset)(rows, tok)
    items = [data[i] for i in range(len(data))]
    ref = {it["index"]: (-1.0 * i, -2.0) for i, it in enumerate(items)}
    step = kto_step if kind == "kto" else preference_step
    grads = []
    for micro in (None, 2):
        model = load_causal_lm(dirs[0])
        step(model, items, ref, pad_token_id=tok.pad_token_id, beta=0.1, kind=kind, micro_batch_size=micro)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    # Each entry sums every response token's contribution (a forward and a backward), in other
    # micro-batches and paddings: float32 rounding of such sums, relative to the largest entry
    # (safety 2: chosen and rejected pull in opposite directions, their terms partly cancel).
    tokens = sum(sum(m for key, mask in it.items() if key.endswith("_mask") for m in mask) for it in items)
    atol = sum_tol(gradient_terms(model.config, tokens), float(grads[0].abs().max()), safety=2)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=atol)


def overrides(dirs, run_dir, *extra: str) -> list[str]:
    policy, ref, root = dirs
    return [
        f"model.path={policy}",
        f"model.ref_path={ref}",
        f"data.train_files={root / 'pairs.jsonl'}",
        f"data.val_files={root / 'pairs.jsonl'}",
        "data.train_batch_size=8",
        "data.micro_batch_size_per_gpu=4",
        "optim.lr=3e-3",
        "trainer.total_epochs=3",
        "trainer.save_freq=5",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


def test_a_short_run_learns_keeps_its_reference_and_resumes(dirs, tmp_path):
    from tearless.models.loading import load_causal_lm

    args = overrides(dirs, tmp_path / "run")
    trainer = DPOTrainer(load_config(None, args, schema=DPOConfig), log=lambda _: None)
    # The stored reference log-probs are those of a live forward of model.ref_path, not of the policy.
    ref_model = load_causal_lm(dirs[1])
    live = reference_logps(ref_model, trainer.val_set, pad_token_id=trainer.tokenizer.pad_token_id)
    first = trainer.val_set[0]
    by_hand = (
        hand_logp(ref_model, first["chosen_ids"], first["chosen_mask"]),
        hand_logp(ref_model, first["rejected_ids"], first["rejected_mask"]),
    )
    # The trainer's micro-batches of the reference forward against one plain forward per sequence,
    # and against one batch of all pairs (the default micro-batch size): equal to rounding.
    delta = sequence_logp_tol(ref_model, [trainer.val_set[i] for i in range(len(trainer.val_set))])
    # Nothing is computed before it is needed: the first validation fills the held-out items, each
    # training step its own batch.
    assert trainer.ref == {"train": {}, "val": {}}
    summary = trainer.fit()
    assert trainer.ref["val"][first["index"]] == pytest.approx(by_hand, abs=delta)
    assert trainer.ref["val"].keys() == live.keys()
    for index, logps in live.items():  # pytest >= 9.2 refuses approx over a dict of tuples
        assert trainer.ref["val"][index] == pytest.approx(logps, abs=delta)
    assert len(trainer.ref["train"]) == len(trainer.train_set)
    stored = {k: dict(v) for k, v in trainer.ref.items()}

    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 9 and summary["steps"] == 9
    for key in (*DPO_METRICS, "train/loss", "train/grad_norm", "train/lr"):
        assert all(math.isfinite(r[key]) for r in steps), key
    assert steps[-1]["train/loss"] < steps[0]["train/loss"] - 0.1
    after, before = summary["after"], summary["before"]
    assert after["val/rewards/accuracies"] > before["val/rewards/accuracies"]
    assert after["val/loss"] < before["val/loss"]

    from transformers import AutoModelForCausalLM

    final = tmp_path / "run" / "global_step_9"
    weights = AutoModelForCausalLM.from_pretrained(final / "actor").state_dict()
    assert torch.load(final / "trainer_state.pt", weights_only=False)["reference_logps"] == stored
    # Lose the last checkpoint: the rerun resumes at step 5 with the saved reference log-probs
    # (it never loads the reference model again) and lands on the same weights.
    shutil.rmtree(final)
    again = DPOTrainer(load_config(None, args, schema=DPOConfig), log=lambda _: None)
    assert again.start_step == 5 and again.ref == stored
    again.fit()
    resumed = AutoModelForCausalLM.from_pretrained(final / "actor").state_dict()
    # Exactly: the same process and thread count (one_thread), and the checkpoint restores the state
    # bit for bit, so the replayed steps do the same operations on the same numbers.
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


def test_reference_free_rewards_are_beta_times_the_policy_logprobs(dirs, tmp_path):
    args = overrides(dirs, tmp_path / "run", "algorithm.reference_free=true", "model.ref_path=null")
    trainer = DPOTrainer(load_config(None, args, schema=DPOConfig), log=lambda _: None)
    val = trainer.validate()
    assert trainer.ref_model is None and set(trainer.ref["val"].values()) == {(0.0, 0.0)}
    beta = trainer.cfg.algorithm.beta
    assert val["val/rewards/chosen"] == pytest.approx(beta * val["val/logps/chosen"], rel=1e-5)


def test_kto_step_equals_kto_loss_on_hand_computed_logprobs(dirs):
    from tearless.models.loading import load_causal_lm, load_tokenizer

    tok, model = load_tokenizer(dirs[0]), load_causal_lm(dirs[0])
    rows = [
        {"prompt": "12+9=", "completion": "21", "label": True},
        {"prompt": "5+5=", "completion": "100", "label": False},
        {"prompt": "40+2=", "completion": "42", "label": True},
    ]
    data = UnpairedDataset(rows, tok)
    items = [data[i] for i in range(3)]
    ref = {0: (-9.0, -8.0), 1: (-7.5, -12.0), 2: (-6.0, -5.0)}  # (response, KL sequence)
    policy = torch.tensor([hand_logp(model, it["completion_ids"], it["completion_mask"]) for it in items])
    kl_policy = torch.tensor([hand_logp(model, it["kl_ids"], it["kl_mask"]) for it in items])
    z = kto_reference_point(kl_policy, torch.tensor([-8.0, -12.0, -5.0]))
    desirable = torch.tensor([True, False, True])
    kw = dict(beta=0.5, desirable_weight=1.0, undesirable_weight=1.5)
    loss, rewards = kto_loss(policy, torch.tensor([-9.0, -7.5, -6.0]), desirable, z, **kw)
    got = kto_step(model, items, ref, pad_token_id=tok.pad_token_id, micro_batch_size=2, train=False, **kw)
    delta = max(
        sequence_logp_tol(model, [{"chosen_mask": it["completion_mask"], "rejected_mask": it["kl_mask"]}])
        for it in items
    )
    assert got["kl"] == pytest.approx(z.item(), abs=delta)
    # kto's slope in each log-prob (and in z) is at most β/4 per example, times its weight, over 3.
    assert got["loss"] == pytest.approx(loss.item(), abs=2 * 1.5 * 0.5 / 4 * delta)
    assert got["rewards/chosen"] == pytest.approx(rewards[desirable].mean().item(), abs=0.5 * delta)
    assert got["rewards/rejected"] == pytest.approx(rewards[1].item(), abs=0.5 * delta)
    assert got["logps/rejected"] == pytest.approx(policy[1].item(), abs=delta)


def test_a_kto_run_learns_and_resumes_and_orpo_uses_no_reference(dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    args = overrides(dirs, tmp_path / "kto", "algorithm.loss_type=kto", "algorithm.beta=0.5")
    trainer = DPOTrainer(load_config(None, args, schema=DPOConfig), log=lambda _: None)
    assert len(trainer.train_set) == 48  # 24 pairs, two examples each
    summary = trainer.fit()
    stored = {k: dict(v) for k, v in trainer.ref.items()}
    assert len(stored["train"]) == 48 and len(stored["val"]) == len(trainer.val_set)
    before, after = summary["before"], summary["after"]
    assert after["val/rewards/margins"] > before["val/rewards/margins"] + 0.5
    assert after["val/loss"] < before["val/loss"]
    final = tmp_path / "kto" / "global_step_18"
    weights = AutoModelForCausalLM.from_pretrained(final / "actor").state_dict()
    shutil.rmtree(final)
    again = DPOTrainer(load_config(None, args, schema=DPOConfig), log=lambda _: None)
    assert again.start_step == 15 and again.ref == stored
    again.fit()
    resumed = AutoModelForCausalLM.from_pretrained(final / "actor").state_dict()
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)

    args = overrides(dirs, tmp_path / "orpo", "algorithm.loss_type=orpo", "model.ref_path=null")
    orpo = DPOTrainer(load_config(None, args, schema=DPOConfig), log=lambda _: None)
    summary = orpo.fit()
    assert orpo.ref_model is None and set(orpo.ref["train"].values()) == {(0.0, 0.0)}
    assert summary["after"]["val/rewards/accuracies"] > summary["before"]["val/rewards/accuracies"]
    assert summary["after"]["val/logps/chosen"] > summary["before"]["val/logps/chosen"]  # its NLL term


def test_cli_config_errors(capsys):
    assert main(["dpo", "algorithm.loss_type=bco"]) == 2
    assert "algorithm.loss_type: 'bco' is not one of aot, aot_unpaired, apo_down" in capsys.readouterr().err
    assert main(["dpo", "algorithm.loss_type=ipo", "algorithm.label_smoothing=0.1"]) == 2
    err = capsys.readouterr().err
    assert (
        "algorithm.label_smoothing: is not defined for loss_type=ipo. Set it to 0 or use a loss type" in err
    )
    assert main(["dpo", "algorithm.label_smoothing=0.1"]) == 2
    assert "TRL >= 0.29 ignores it for sigmoid: use algorithm.loss_type=robust" in capsys.readouterr().err
    assert main(["dpo", "algorithm.loss_type=aot", "data.micro_batch_size_per_gpu=4"]) == 2
    assert "aot sorts the margins of the whole step" in capsys.readouterr().err
    assert main(["dpo", "algorithm.loss_type=orpo", "model.ref_path=/x"]) == 2
    assert "model.ref_path: is set but loss_type=orpo here uses no reference" in capsys.readouterr().err
    assert main(["dpo", "algorithm.loss_type=kto", "algorithm.reference_free=true"]) == 2
    assert "algorithm.reference_free: loss_type=kto needs its reference" in capsys.readouterr().err
    assert main(["dpo", "--help", "algorithm.beta=0.3"]) == 0
    assert "algorithm.beta = 0.3\n    β" in capsys.readouterr().out


def test_embedded_pairs_pit_a_correct_answer_against_an_incorrect_one(task, tmp_path):
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.tasks.preferences import prepare_pairs

    spec = TaskSpec(**task.info["spec"])
    logs: list[str] = []
    pairs = prepare_pairs(spec, task, tmp_path, samples_per_prompt=4, log=logs.append)
    assert any("making preference pairs" in line for line in logs)
    from tearless.data import load_rows

    for name in ("train_file", "val_file"):
        rows = load_rows(getattr(pairs, name))
        assert len(rows) >= 10
        for row in rows:
            truth = row["reward_model"]["ground_truth"]
            assert arithmetic.compute_score(row["chosen"], truth) == 1.0
            assert arithmetic.compute_score(row["rejected"], truth) == 0.0
    assert pairs.info["train_pairs"] == len(load_rows(pairs.train_file)) <= spec.num_train
    logs.clear()
    assert prepare_pairs(spec, task, tmp_path, samples_per_prompt=4, log=logs.append) == pairs
    assert logs == []  # cached


def test_pairs_follow_the_scorer_they_are_given(task):
    """``make_pairs(score=…)``: the given verdict decides chosen and rejected. With the embedded task's
    score inverted, the same samples give pairs for the same prompts, with sides swapped."""
    from tearless.data import load_rows
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.tasks.preferences import make_pairs

    def inverted(answer: str, truth: object) -> float:
        return 1.0 - arithmetic.compute_score(answer, truth)

    model, tokenizer = load_causal_lm(task.model_dir), load_tokenizer(task.model_dir)
    rows = load_rows(task.train_file)[:40]
    settings = dict(samples_per_prompt=4, temperature=1.0, max_new_tokens=16, seed=0)
    usual = make_pairs(model, tokenizer, rows, **settings)
    swapped = make_pairs(model, tokenizer, rows, **settings, score=inverted)
    assert len(swapped) == len(usual) >= 5
    for pair, other in zip(swapped, usual, strict=True):
        truth = pair["reward_model"]["ground_truth"]
        assert pair["prompt"] == other["prompt"]
        assert arithmetic.compute_score(pair["chosen"], truth) == 0.0
        assert arithmetic.compute_score(pair["rejected"], truth) == 1.0
        assert pair["extra_info"]["num_correct"] == 4 - other["extra_info"]["num_correct"]
