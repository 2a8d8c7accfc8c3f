"""Loading models and tokenizers from local directories; response log-probs and entropy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tearless.models.loading import NonFiniteWeights, load_causal_lm, load_tokenizer, resolve_dtype
from tearless.models.logprobs import response_logprobs, sequence_inputs
from tests.tolerances import LOGIT_BOUND, entropy_tol, eps, logit_tol, logprob_tol, sum_tol


@pytest.fixture(scope="module")
def model(task):
    return load_causal_lm(task.model_dir)


def test_missing_directories_name_the_config_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref\.model\.path=.*or at a Hub model ID"):
        load_causal_lm(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"actor_rollout_ref\.model\.tokenizer_path="):
        load_tokenizer(tmp_path, key="actor_rollout_ref.model.tokenizer_path")  # exists, but empty


def test_tokenizer_is_left_padded_with_a_pad_that_is_not_eos(task):
    tok = load_tokenizer(task.model_dir)
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id


def test_a_tokenizer_without_pad_gets_eos_as_pad(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from tearless.tasks.tokenizer import build_char_tokenizer

    base = build_char_tokenizer()
    bare = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="<|end|>")
    bare.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.pad_token_id == tok.eos_token_id == base.eos_token_id


def test_dtypes():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8")


def test_load_in_bfloat16_and_with_gradient_checkpointing(task):
    m = load_causal_lm(task.model_dir, dtype="bfloat16", gradient_checkpointing=True)
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m.config.use_cache is False


def test_sequence_inputs_drop_all_pad_columns_and_count_positions_from_the_mask():
    prompt_ids = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]])
    prompt_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    response_ids = torch.tensor([[1, 2, 0], [3, 0, 0]])
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    ids, mask, pos = sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    assert ids.tolist() == [[0, 5, 6, 1, 2, 0], [7, 8, 9, 3, 0, 0]]
    assert mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]
    assert pos.tolist() == [[0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 3, 3]]


def test_response_log_probs_and_entropy_match_a_plain_forward_of_each_row(model):
    # Row 0: prompt [7 tokens] + response [3 tokens]; row 1: prompt [9] + response [5]; left-padded
    # prompts, right-padded responses. Each row is also run alone, unpadded, as the reference.
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 100, (7,), generator=g), torch.randint(10, 100, (9,), generator=g)]
    responses = [torch.randint(10, 100, (3,), generator=g), torch.randint(10, 100, (5,), generator=g)]
    prompt_ids = torch.zeros(2, 9, dtype=torch.long)
    prompt_mask = torch.zeros(2, 9, dtype=torch.long)
    response_ids = torch.zeros(2, 5, dtype=torch.long)
    response_mask = torch.zeros(2, 5, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        prompt_ids[i, 9 - len(p) :], prompt_mask[i, 9 - len(p) :] = p, 1
        response_ids[i, : len(r)], response_mask[i, : len(r)] = r, 1
    temperature = 0.8
    # Padded batch against a row alone: other shapes, other kernels and summation orders, so equal
    # to the forward's rounding (logits scaled by 1/temperature).
    lp_atol = logprob_tol(model.config, logit_bound=LOGIT_BOUND / temperature)
    ent_atol = entropy_tol(model.config, logit_bound=LOGIT_BOUND / temperature)
    with torch.no_grad():
        lp, ent = response_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            temperature=temperature,
            with_entropy=True,
        )
        assert lp.shape == ent.shape == (2, 5)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            logits = model(torch.cat([p, r])[None]).logits[0, len(p) - 1 : -1] / temperature
            logp = torch.log_softmax(logits, -1)
            want = logp.gather(-1, r[:, None]).squeeze(-1)
            torch.testing.assert_close(lp[i, : len(r)], want, atol=lp_atol, rtol=0)
            want_ent = -(logp.exp() * logp).sum(-1)
            torch.testing.assert_close(ent[i, : len(r)], want_ent, atol=ent_atol, rtol=0)


def test_entropy_has_gradient_only_when_asked(model):
    ids = torch.tensor([[5, 6, 7]])
    one = torch.ones_like(ids)
    _, plain = response_logprobs(model, ids, one, ids, one, with_entropy=True)
    _, grad = response_logprobs(model, ids, one, ids, one, with_entropy="grad")
    lp, none = response_logprobs(model, ids, one, ids, one)
    assert not plain.requires_grad and grad.requires_grad and lp.requires_grad and none is None


@pytest.mark.parametrize("overhead", [64, 0], ids=["one-bucket", "a-bucket-per-length"])
def test_rows_sharing_a_prompt_give_the_log_probs_and_gradient_of_separate_forwards(
    model, overhead, monkeypatch
):
    # Two prompts (5 and 8 tokens) with three responses each (lengths 1-6), rows of a prompt adjacent
    # as the sampler lays them out: the prompt pass runs once per prompt and is gathered for its rows.
    # With no cost per forward, every response length gets a bucket of its own (5 response passes
    # over rows of both prompts). Reference: each row forwarded on its own, one plain pass over the
    # whole sequence (``share_prompts=False``). In a float64 model, so that tolerances check
    # the maths rather than rounding; even so the log-softmax runs in float32 (the log-prob contract)
    # and transformers keeps the rotary tables in float32, so gradient entries agree to ~1e-7 of the
    # largest one (measured 1e-7), not to float64 precision: see float64_model_tols.
    import copy

    import tearless.models.logprobs as logprobs
    from tearless.models.logprobs import shared_prompt_runs

    monkeypatch.setattr(logprobs, "bucket_overhead_tokens", lambda device_type: overhead)
    model = copy.deepcopy(model).double()
    passes = []
    hook = model.lm_head.register_forward_hook(lambda *_: passes.append(1))

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 100, (5,), generator=g), torch.randint(10, 100, (8,), generator=g)]
    lengths = [[3, 6, 2], [4, 1, 5]]
    rows = [(p, torch.randint(10, 100, (n,), generator=g)) for p, ns in zip(prompts, lengths, strict=True)
            for n in ns]  # fmt: skip
    prompt_ids = torch.zeros(6, 8, dtype=torch.long)
    prompt_mask = torch.zeros(6, 8, dtype=torch.long)
    response_ids = torch.zeros(6, 6, dtype=torch.long)
    response_mask = torch.zeros(6, 6, dtype=torch.long)
    for i, (p, r) in enumerate(rows):
        prompt_ids[i, 8 - len(p) :], prompt_mask[i, 8 - len(p) :] = p, 1
        response_ids[i, : len(r)], response_mask[i, : len(r)] = r, 1
    assert shared_prompt_runs(prompt_ids, prompt_mask).tolist() == [3, 3]
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(lp, mask):
        loss = (lp * mask).sum()
        return lp.detach(), torch.autograd.grad(loss, params)

    shared, shared_grads = loss_and_grads(
        response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=0.9)[0],
        response_mask,
    )
    hook.remove()
    # The prompt pass, then the response buckets (the 1-token response needs only the prompt's logits).
    assert len(passes) == (2 if overhead else 1 + 5)
    separate = []
    total_grads = [torch.zeros_like(p) for p in params]
    for i in range(6):
        lp, grads = loss_and_grads(
            response_logprobs(
                model, prompt_ids[i : i + 1], prompt_mask[i : i + 1], response_ids[i : i + 1],
                response_mask[i : i + 1], temperature=0.9, share_prompts=False,
            )[0],
            response_mask[i : i + 1],
        )  # fmt: skip
        separate.append(lp)
        total_grads = [t + g_ for t, g_ in zip(total_grads, grads, strict=True)]
    mask = response_mask.bool()
    lp_atol, grad_rtol = float64_model_tols(model.config, temperature=0.9, n_tokens=int(mask.sum()))
    torch.testing.assert_close(shared[mask], torch.cat(separate)[mask], atol=lp_atol, rtol=0)
    for a, b in zip(shared_grads, total_grads, strict=True):
        torch.testing.assert_close(a, b, atol=grad_rtol * float(b.abs().max()), rtol=0)
    assert sum(float(t.abs().sum()) for t in shared_grads) > 0


def float64_model_tols(config, temperature, n_tokens):
    """(log-prob atol, gradient tolerance relative to the largest entry) between two differently
    batched forwards and backwards of a float64 model whose log-softmax runs in float32.

    The float64 logits agree to ~1e-12 (logit_tol in float64), but the cast to float32 can put one of
    them on the neighbouring float, one ulp (eps·|z|) away: the same float32 log-softmax code then
    moves a log-prob by at most that, for z_y and for the log-sum-exp. The gradient leaves the loss
    through that float32 log-softmax (its backward sums over the vocabulary in float32), and each
    entry sums it over the rows' tokens.
    """
    bound = LOGIT_BOUND / temperature
    lp_atol = 2 * logit_tol(config, torch.float64, bound) + 2 * eps(torch.float32) * bound
    return lp_atol, sum_tol(config.vocab_size + n_tokens, 1.0)


def test_duplicate_sequences_are_forwarded_once_with_the_gradient_of_separate_forwards(model):
    # Prompt A with responses r1, r1 (its copy has other garbage after its end), r2; prompt B with r3
    # three times. Each row's loss weight differs, so each duplicate's gradient counts on its own.
    # Only the 3 distinct responses are forwarded (plus the 2 prompts once); log-probs and gradient
    # equal those of one plain forward per row.
    import copy

    from tearless.models.logprobs import distinct_rows

    model = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(10, 100, (5,), generator=g), torch.randint(10, 100, (7,), generator=g)]
    r1, r2, r3 = (torch.randint(10, 100, (n,), generator=g) for n in (4, 6, 3))
    rows = [(0, r1), (0, r1), (0, r2), (1, r3), (1, r3), (1, r3)]
    prompt_ids = torch.zeros(6, 7, dtype=torch.long)
    prompt_mask = torch.zeros(6, 7, dtype=torch.long)
    response_ids = torch.full((6, 6), 3, dtype=torch.long)
    response_mask = torch.zeros(6, 6, dtype=torch.long)
    for i, (k, r) in enumerate(rows):
        prompt_ids[i, 7 - len(prompts[k]) :], prompt_mask[i, 7 - len(prompts[k]) :] = prompts[k], 1
        response_ids[i, : len(r)], response_mask[i, : len(r)] = r, 1
    response_ids[1, 5] = 42  # past r1's end: not part of the sequence
    rep, inverse = distinct_rows(prompt_ids, prompt_mask, response_ids, response_mask, response_mask.sum(-1))
    assert len(rep) == 3 and inverse.tolist()[:2] == [inverse[0]] * 2 and len(set(inverse[3:].tolist())) == 1
    assert (rep[inverse] != torch.arange(6)).sum() == 3  # rows 1, 4 and 5 (or their twins) are copies

    weights = torch.tensor([1.0, -2.0, 0.5, 3.0, 1.5, -1.0], dtype=torch.float64)[:, None]
    params = [p for p in model.parameters() if p.requires_grad]
    forwarded = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: forwarded.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    lp = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)[0]
    hook.remove()
    grads = torch.autograd.grad((lp * weights * response_mask).sum(), params)
    assert forwarded[0] == 2 and sum(forwarded[1:]) == 3  # two prompts, then three distinct responses
    separate, total = [], [torch.zeros_like(p) for p in params]
    for i in range(6):
        one = response_logprobs(
            model, prompt_ids[i : i + 1], prompt_mask[i : i + 1], response_ids[i : i + 1],
            response_mask[i : i + 1], share_prompts=False,
        )[0]  # fmt: skip
        separate.append(one.detach())
        one_grads = torch.autograd.grad((one * weights[i] * response_mask[i]).sum(), params)
        total = [t + g_ for t, g_ in zip(total, one_grads, strict=True)]
    mask = response_mask.bool()
    lp_atol, grad_rtol = float64_model_tols(model.config, temperature=1.0, n_tokens=int(mask.sum()))
    torch.testing.assert_close(lp.detach()[mask], torch.cat(separate)[mask], atol=lp_atol, rtol=0)
    assert (lp.detach()[~mask] == 0).all()
    for a, b in zip(grads, total, strict=True):
        torch.testing.assert_close(a, b, atol=grad_rtol * float(b.abs().max()), rtol=0)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=1, max_size=9),
    overhead=st.integers(0, 20),
)
def test_length_buckets_are_the_cheapest_split(lengths, overhead):
    # Brute force over every split of the sorted distinct lengths into runs (the cheapest grouping is
    # always such a split: putting a shorter row into a longer row's group never helps).
    import itertools

    from tearless.models.logprobs import length_buckets

    groups = length_buckets(lengths, overhead)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))

    def cost(gs):
        return sum(len(g) * max(lengths[r] for r in g) + overhead for g in gs)

    values = sorted(set(lengths))
    best = float("inf")
    for cuts in itertools.product([False, True], repeat=len(values) - 1):
        bounds = [0, *[k + 1 for k, c in enumerate(cuts) if c], len(values)]
        runs = [set(values[a:b]) for a, b in itertools.pairwise(bounds)]
        best = min(best, cost([[r for r, n in enumerate(lengths) if n in run] for run in runs]))
    assert cost(groups) == best


def test_length_buckets_by_hand():
    from tearless.models.logprobs import length_buckets

    # 40 rows of 10 and one of 60: one group costs 41 · 60 = 2,460, two cost 400 + 60 + 2 · 64 = 588.
    assert length_buckets([10] * 40 + [60], 64) == [list(range(40)), [40]]
    # Lengths 9 to 11: splitting saves at most 2 per row, less than one more forward.
    assert length_buckets([9, 10, 11, 10, 9, 11], 64) == [[0, 1, 2, 3, 4, 5]]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_at_load_naming_the_tensor(task, tmp_path, value):
    # Was found only after the first update, and blamed on the learning rate.
    model = load_causal_lm(task.model_dir)
    name, param = list(model.named_parameters())[3]
    with torch.no_grad():
        param.view(-1)[:2] = value
    model.save_pretrained(tmp_path / "m")
    with pytest.raises(NonFiniteWeights) as info:
        load_causal_lm(tmp_path / "m", key="critic.model.path")
    assert str(info.value).startswith(
        f"critic.model.path={tmp_path / 'm'}: the weights hold 2 non-finite values (first in {name})"
    )
