"""The multi-hop QA task: a knowledge base whose held-out facts never appear in training, a corpus the
search tool ranks correctly, teacher trajectories laid out as the agent loop lays out a rollout."""

from __future__ import annotations

import json
import random

import pytest

from tearless.rewards import compute_score
from tearless.rollout.agent import AgentSettings, SearchR1Format
from tearless.tasks import multihop
from tearless.tasks.bootstrap import TaskSpec
from tearless.tasks.tokenizer import build_char_tokenizer
from tearless.tools import load_tools
from tearless.tools.search import SearchTool
from tearless.trainers.warmup import prepare_task


@pytest.fixture(scope="module")
def kb():
    return multihop.make_kb(3, (60, 20))


def test_families_never_mix_so_held_out_answers_are_unseen(kb):
    people = kb["people"]
    assert len(people) == 80 and len(kb["cities"]) == multihop.NUM_CITIES == len(set(kb["cities"]))
    for name, p in people.items():
        assert p["mother"] != name and people[p["mother"]]["family"] == p["family"]
    train, val = multihop.rows_for(kb, 0, "train"), multihop.rows_for(kb, 1, "test")
    assert len(train) == 120 and len(val) == 40
    train_people = {r["extra_info"]["person"] for r in train}
    val_people = {r["extra_info"]["person"] for r in val}
    assert not train_people & val_people
    # No training question is about, or passes through, a held-out person.
    assert all(people[people[p]["mother"]]["family"] == 0 for p in train_people)
    assert multihop.make_kb(3, (60, 20)) == kb and multihop.make_kb(4, (60, 20)) != kb


def test_rows_are_scored_by_exact_match_through_the_searchR1_source(kb):
    row = multihop.rows_for(kb, 1, "test")[1]
    name = row["extra_info"]["person"]
    assert (
        row["extra_info"]["hops"] == 2 and row["prompt"][0]["content"] == f"Where was {name}'s mother born?"
    )
    city = kb["people"][kb["people"][name]["mother"]]["city"]
    gt = row["reward_model"]["ground_truth"]
    assert compute_score(row["data_source"], f"<search>{name}</search><answer>{city}</answer>", gt) == 1.0
    own = kb["people"][name]["city"]
    if own != city:
        assert compute_score(row["data_source"], f"<answer>{own}</answer>", gt) == 0.0


def test_search_returns_the_persons_own_passage_for_every_name(kb, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(multihop.passage(kb, n)) + "\n" for n in kb["people"]))
    tool = SearchTool(str(corpus), topk=1, max_passage_chars=64)
    for name in kb["people"]:
        assert tool.call(query=name) == multihop.passage(kb, name)["text"]


def test_teacher_trajectories_mask_exactly_the_tool_output(kb, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(multihop.passage(kb, n)) + "\n" for n in kb["people"]))
    tok = build_char_tokenizer(extra_tokens=multihop.TAGS)
    tool = SearchTool(str(corpus), topk=1)
    fmt = SearchR1Format({"search": tool}, tok, AgentSettings())
    name = next(iter(kb["people"]))
    mother = kb["people"][name]["mother"]
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        segments = multihop.teacher_segments(kb, name, 2, rng)
        seen.add(len(segments))
        demo = multihop.demo_tokens(segments, [5, 6], fmt, tool)
        ids, mask = demo["input_ids"], demo["loss_mask"]
        assert mask[:2] == [0, 0]
        masked = tok.decode([t for t, m in zip(ids, mask, strict=True) if m == 0 and t not in (5, 6)])
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m == 1])
        passages = "".join(f"<information>{tool.call(q)}</information>" for k, q in segments if k == "search")
        assert masked == passages
        assert trained == "".join(text for k, text in segments if k == "model")
    # Guess, shortcut after one look-up, and the full two look-ups all occur.
    assert seen == {1, 3, 5}
    full = multihop.teacher_segments(kb, name, 2, random.Random(3))
    if len(full) == 5:
        assert full[2] == ("model", f"<search>{mother}</search>")


def test_prepare_task_builds_the_multihop_files_and_its_tool_config(tmp_path):
    spec = TaskSpec(name="multihop", num_train=8, num_val=4, warmup_steps=2, hidden_size=32, num_layers=1)
    files = prepare_task(spec, tmp_path, log=lambda _: None)
    assert files.tool_config_path == str(tmp_path / spec.key() / "tools.yaml")
    tools = load_tools(files.tool_config_path)
    kb = json.loads((tmp_path / spec.key() / "kb.json").read_text())
    name = next(iter(kb["people"]))
    assert tools["search"].call(query=name) == multihop.passage(kb, name)["text"]
    assert files.info["num_people"] == 6 and files.info["warmup_final_loss"] > 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(files.model_dir)
    text = "<search>kat</search><information>kat: born Lora.</information><answer>Lora</answer>"
    ids = tok.encode(text, add_special_tokens=False)
    # The tags are single tokens: 5 (search) + 17 (information) + 6 (answer).
    assert len(ids) == 28 and tok.decode(ids, skip_special_tokens=True) == text
    with pytest.raises(ValueError, match="at least 2 people per family"):
        multihop.make_kb(1, (1, 5))
