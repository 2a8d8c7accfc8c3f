"""Hub model IDs resolved offline from a Hugging Face cache laid out by hand (never the network).

The cache is the layout huggingface_hub writes: ``models--org--name/refs/<ref>`` holding a commit
hash and ``snapshots/<commit>/`` holding the files. ``HF_HUB_OFFLINE=1`` is set in every test, so a
missing entry can only fail, never download.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tearless.models.hub import add_to_hub_cache, is_hub_id, split_revision
from tearless.models.loading import check_model_dir, load_causal_lm, load_tokenizer
from tearless.models.value import load_value_model
from tearless.rewards.model import RewardModelScorer
from tearless.tasks.tokenizer import build_char_tokenizer

SHA_MAIN = "a" * 40
SHA_V2 = "b" * 40


def save_tiny_llama(directory: Path, seed: int) -> Path:
    """A 1-layer Llama (hidden 32) and the embedded task's tokenizer, weights drawn from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def lay_out(cache: Path, repo: str, refs: dict[str, str], snapshots: dict[str, Path]) -> None:
    """Write ``repo``'s cache entry by hand: each ref file holds its commit, each snapshot the files."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    for ref, commit in refs.items():
        (root / "refs" / ref).write_text(commit)
    for commit, source in snapshots.items():
        (root / "snapshots" / commit).mkdir(parents=True)
        for f in source.iterdir():
            (root / "snapshots" / commit / f.name).write_bytes(f.read_bytes())


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hub cache under HF_HOME with ``org/tiny`` at main (seed 0) and tag v2 (seed 1)."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    first = save_tiny_llama(tmp_path / "m0", seed=0)
    second = save_tiny_llama(tmp_path / "m1", seed=1)
    lay_out(home / "hub", "org/tiny", {"main": SHA_MAIN, "v2": SHA_V2}, {SHA_MAIN: first, SHA_V2: second})
    return {"home": home, "first": first, "second": second}


def weight(model: torch.nn.Module) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()


def test_hub_ids_are_told_apart_from_paths(tmp_path):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert is_hub_id("org/name@v1.0")
    assert split_revision("org/name@" + SHA_V2) == ("org/name", SHA_V2)
    assert split_revision("org/name") == ("org/name", None)
    assert not is_hub_id("/abs/path/model") and not is_hub_id("./org/name") and not is_hub_id("model")
    existing = tmp_path / "org" / "name"
    existing.mkdir(parents=True)
    assert not is_hub_id(str(existing))  # a path that exists is always the local directory


def test_a_cached_hub_id_loads_offline_and_revisions_pick_their_snapshot(hub):
    snapshot = check_model_dir("org/tiny", "actor_rollout_ref.model.path")
    assert snapshot == hub["home"] / "hub" / "models--org--tiny" / "snapshots" / SHA_MAIN
    first = weight(load_causal_lm(hub["first"]))
    second = weight(load_causal_lm(hub["second"]))
    assert not torch.equal(first, second)
    # Same bytes on disk, so loading is exact.
    assert torch.equal(weight(load_causal_lm("org/tiny")), first)
    assert torch.equal(weight(load_causal_lm("org/tiny@v2")), second)  # a tag
    assert torch.equal(weight(load_causal_lm(f"org/tiny@{SHA_V2}")), second)  # a commit hash
    assert torch.equal(weight(load_causal_lm(f"org/tiny@{SHA_MAIN}")), first)
    tok = load_tokenizer("org/tiny")
    assert tok.padding_side == "left" and tok.eos_token_id is not None


def test_hub_cache_env_var_wins_over_hf_home(hub, tmp_path, monkeypatch):
    other = tmp_path / "other-cache"
    lay_out(other, "org/tiny", {"main": SHA_V2}, {SHA_V2: hub["second"]})
    monkeypatch.setenv("HF_HUB_CACHE", str(other))
    assert check_model_dir("org/tiny", "k") == other / "models--org--tiny" / "snapshots" / SHA_V2


def test_not_cached_while_offline_fails_in_one_line_naming_the_key(hub):
    with pytest.raises(FileNotFoundError) as err:
        load_causal_lm("org/absent", key="critic.model.path")
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("critic.model.path=org/absent: not a local directory")
    assert "HF_HUB_OFFLINE is set" in text and "hf download org/absent" in text
    with pytest.raises(FileNotFoundError, match=r"at revision 'v9' while HF_HUB_OFFLINE"):
        load_causal_lm("org/tiny@v9")


def test_critic_and_reward_model_resolve_hub_ids(hub, tmp_path):
    from transformers import LlamaForSequenceClassification

    critic = load_value_model("org/tiny@v2")
    # The backbone is the v2 snapshot's; the value head is new and zeroed.
    assert torch.equal(weight(critic), weight(load_causal_lm(hub["second"])))
    assert float(critic.score.weight.detach().abs().sum()) == 0.0
    rm_dir = tmp_path / "rm"
    torch.manual_seed(2)
    LlamaForSequenceClassification.from_pretrained(hub["first"], num_labels=1).save_pretrained(rm_dir)
    build_char_tokenizer().save_pretrained(rm_dir)
    lay_out(hub["home"] / "hub", "org/rm", {"main": SHA_MAIN}, {SHA_MAIN: rm_dir})
    by_id = RewardModelScorer("org/rm").score(["1+2="], ["3"])
    by_dir = RewardModelScorer(str(rm_dir)).score(["1+2="], ["3"])
    assert by_id == by_dir


def test_add_to_hub_cache_writes_what_huggingface_hub_reads(hub, tmp_path):
    from huggingface_hub import scan_cache_dir

    cache = tmp_path / "seeded"
    snapshot = add_to_hub_cache(hub["second"], "acme/copy@v3", commit=SHA_V2, cache_dir=cache)
    assert (snapshot / "config.json").is_file()
    info = scan_cache_dir(cache)
    (repo,) = info.repos
    assert repo.repo_id == "acme/copy" and {r.commit_hash for r in repo.revisions} == {SHA_V2}
    assert next(iter(repo.revisions)).refs == frozenset({"v3"})


def test_rl_training_takes_hub_ids_for_actor_reference_and_critic(hub, tmp_path, task):
    """One PPO step with a KL loss: the actor, the reference and the critic all come from the cache."""
    from tearless.config import load_config
    from tearless.trainers.rl import RLTrainer
    from tests.conftest import small_overrides

    run = tmp_path / "run"
    overrides = small_overrides(task, run)
    overrides[0] = "actor_rollout_ref.model.path=org/tiny@v2"
    cfg = load_config(
        None,
        [
            *overrides,
            "critic.model.path=org/tiny",
            "algorithm.adv_estimator=gae",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "data.val_max_samples=8",
        ],
        notify=lambda _: None,
    )
    summary = RLTrainer(cfg, log=lambda _: None).fit()
    assert summary["steps"] == 1
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines() if '"actor/kl_loss"' in line]
    assert rows, "the step logged no KL loss: the reference did not run"
    saved = load_causal_lm(Path(summary["checkpoint"]) / "actor")
    start = load_causal_lm(hub["second"])
    # The step moved the v2 snapshot's weights (the start), not main's.
    moved = (weight(saved) - weight(start)).abs().max()
    assert 0 < moved < (weight(saved) - weight(load_causal_lm(hub["first"]))).abs().max()
