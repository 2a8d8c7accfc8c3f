"""The embedded multi-hop QA task: questions about a synthetic knowledge base that need the search tool.

Per seed, a knowledge base of people is drawn: each person (a three-letter name such as ``kat``) was
born in one of ten cities (``Lora``, …) and has a mother, another person. The corpus for the search
tool holds one passage per person, ``"kat: born Lora, mother bim."``. Questions:

- one hop: ``"Where was kat born?"`` → search ``kat`` → ``Lora``;
- two hops: ``"Where was kat's mother born?"`` → search ``kat`` (mother ``bim``) → search ``bim`` →
  its city.

People are split into two families that never mix (mothers are drawn within a family): training
questions are about one family, held-out questions about the other, so no training reward reveals a
held-out fact and, without the tool, a held-out answer is a guess (chance = 1 / number of cities).

The tiny model is warmed up by SFT on trajectories of a deliberately imperfect teacher that uses the
real search tool and the agent loop's token layout (tool output masked from the loss): it answers at
once with a random city ``guess_rate`` of the time (so greedy decoding starts at chance) and, on two-hop
questions, answers after the first look-up ``shortcut_rate`` of the time (the first passage's city).
Sampling still finds the searching behaviour often enough for RL to make it the greedy one.
"""

from __future__ import annotations

import random
from typing import Any

DATA_SOURCE = "searchR1_multihop"
TAGS = ("<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>")
NUM_CITIES = 10
GUESS_RATE = 0.6
SHORTCUT_RATE = 0.15
TWO_HOP_SHARE = 0.7  # of the warm-up's demonstrations: the second look-up is the harder copy to learn
TOPK = 1
MAX_PASSAGE_CHARS = 64
_CONSONANTS, _VOWELS = "bcdfghjklmnprstvwz", "aeiou"


def _names(rng: random.Random, count: int, pattern: str, taken: set[str]) -> list[str]:
    """``count`` distinct names of the pattern ``c``/``v`` (consonant/vowel), none in ``taken``."""
    out: list[str] = []
    while len(out) < count:
        name = "".join(rng.choice(_CONSONANTS if ch == "c" else _VOWELS) for ch in pattern)
        if name not in taken:
            taken.add(name)
            out.append(name)
    return out


def make_kb(seed: int, people_per_family: tuple[int, int]) -> dict:
    """The knowledge base of ``seed``: ``people`` {name: {"city", "mother", "family"}} and ``cities``.

    Family 0 (``people_per_family[0]`` people) is asked about in training, family 1 in validation.
    """
    total = sum(people_per_family)
    if total > len(_CONSONANTS) ** 2 * len(_VOWELS) // 2:
        raise ValueError(f"the multihop task can name at most 1620 people, asked for {total}")
    if min(people_per_family) < 2:
        raise ValueError(
            "the multihop task needs at least 2 people per family (task.num_train, task.num_val >= 4)"
        )
    rng = random.Random(seed)
    taken: set[str] = set()
    cities = [c.capitalize() for c in _names(rng, NUM_CITIES, "cvcv", taken)]
    people: dict[str, dict] = {}
    for family, count in enumerate(people_per_family):
        names = _names(rng, count, "cvc", taken)
        for name in names:
            mother = rng.choice([m for m in names if m != name])
            people[name] = {"city": rng.choice(cities), "mother": mother, "family": family}
    return {"people": people, "cities": cities}


def passage(kb: dict, name: str) -> dict:
    """The corpus passage of ``name`` (title indexed for ranking, text returned by the tool)."""
    p = kb["people"][name]
    return {"title": name, "text": f"{name}: born {p['city']}, mother {p['mother']}."}


def answer_of(kb: dict, name: str, hops: int) -> str:
    person = kb["people"][name]
    return kb["people"][person["mother"]]["city"] if hops == 2 else person["city"]


def question(name: str, hops: int) -> str:
    return f"Where was {name}'s mother born?" if hops == 2 else f"Where was {name} born?"


def rows_for(kb: dict, family: int, split: str) -> list[dict]:
    """One one-hop and one two-hop question per person of ``family`` (veRL schema rows)."""
    rows = []
    for name, p in kb["people"].items():
        if p["family"] != family:
            continue
        for hops in (1, 2):
            rows.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": question(name, hops)}],
                    "ability": "qa",
                    "reward_model": {
                        "style": "rule",
                        "ground_truth": {"target": [answer_of(kb, name, hops)]},
                    },
                    "extra_info": {"split": split, "index": len(rows), "person": name, "hops": hops},
                }
            )
    return rows


def teacher_segments(kb: dict, name: str, hops: int, rng: random.Random) -> list[tuple[str, str]]:
    """The flawed teacher's trajectory as (``model`` | ``search``, text) segments; a ``search``
    segment is the query whose tool output follows (see the module docstring for the flaws)."""
    if rng.random() < GUESS_RATE:
        return [("model", f"<answer>{rng.choice(kb['cities'])}</answer>")]
    segments = [("model", f"<search>{name}</search>"), ("search", name)]
    if hops == 1 or rng.random() < SHORTCUT_RATE:
        return [*segments, ("model", f"<answer>{kb['people'][name]['city']}</answer>")]
    mother = kb["people"][name]["mother"]
    return [
        *segments,
        ("model", f"<search>{mother}</search>"),
        ("search", mother),
        ("model", f"<answer>{answer_of(kb, name, 2)}</answer>"),
    ]


def demo_tokens(segments: list[tuple[str, str]], prompt_ids: list[int], fmt: Any, tool: Any) -> dict:
    """``{"input_ids", "loss_mask"}`` of a teacher trajectory, laid out as the agent loop lays out a
    rollout: tool output (the real tool's, wrapped by the real format) has loss mask 0."""
    ids, mask = list(prompt_ids), [0] * len(prompt_ids)
    for kind, text in segments:
        if kind == "model":
            piece = list(fmt.tokenizer.encode(text, add_special_tokens=False))
            ids += piece
            mask += [1] * len(piece)
        else:
            piece = fmt.result_tokens([tool.call(text)])
            ids += piece
            mask += [0] * len(piece)
    return {"input_ids": ids, "loss_mask": mask}


def tools_yaml() -> str:
    return (
        "tools:\n"
        "  - class_name: search\n"
        f"    config: {{corpus_path: corpus.jsonl, topk: {TOPK}, max_passage_chars: {MAX_PASSAGE_CHARS}}}\n"
    )
