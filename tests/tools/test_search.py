"""BM25 search: a hand-computed score, deterministic ranking, the corpus formats and their errors."""

from __future__ import annotations

import json
import math

import pytest

from tearless.tools.search import BM25Index, SearchTool, read_corpus, terms


def test_bm25_score_matches_the_formula_by_hand():
    # docs: "a b" (2 terms), "a c c" (3), "d" (1); avgdl = 2, N = 3. Query "c": n(c) = 1,
    # IDF = ln(1 + (3 - 1 + 0.5) / 1.5) = ln(8/3); doc 1: tf = 2,
    # score = IDF · 2 · 2.5 / (2 + 1.5 · (0.25 + 0.75 · 3/2)) = ln(8/3) · 5 / 4.0625.
    index = BM25Index(["a b", "a c c", "d"])
    ((doc, score),) = index.search("c", 5)
    assert doc == 1
    assert score == pytest.approx(math.log(8 / 3) * 5 / 4.0625, rel=1e-12)
    # "a" is in two docs: IDF = ln(1 + 1.5/2.5); the shorter doc 0 wins.
    hits = index.search("a", 5)
    assert [d for d, _ in hits] == [0, 1]
    assert hits[0][1] == pytest.approx(math.log(1.6) * 2.5 / (1 + 1.5 * (0.25 + 0.75 * 2 / 2)))
    assert index.search("zzz", 3) == [] and index.search("", 3) == []


def test_ties_break_by_corpus_order_and_terms_are_case_and_punctuation_blind():
    assert terms("Kat: born Lora, mother bim.") == ["kat", "born", "lora", "mother", "bim"]
    index = BM25Index(["x y", "y x", "x y"])
    assert [d for d, _ in index.search("X!", 3)] == [0, 1, 2]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_title_makes_a_passage_rank_first_for_its_own_name(tmp_path):
    corpus = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"title": "bim", "text": "bim: born Kovu, mother kat."},  # mentions kat once
            {"title": "kat", "text": "kat: born Lora, mother bim."},  # kat in title and text
            {"title": "dol", "text": "dol: born Refo, mother bim."},
        ],
    )
    tool = SearchTool(str(corpus), topk=2, max_passage_chars=12)
    assert tool.call(query="kat") == "kat: born Lo\nbim: born Ko"
    assert SearchTool(str(corpus), topk=1).call(query="nobody") == "no results"


def test_flashrag_contents_and_clear_errors(tmp_path):
    flash = write_jsonl(tmp_path / "f.jsonl", [{"id": "0", "contents": '"Paris"\nCapital of France.'}])
    assert read_corpus(flash) == [{"title": "Paris", "text": "Capital of France."}]
    with pytest.raises(FileNotFoundError, match="corpus_path"):
        read_corpus(tmp_path / "missing.jsonl")
    bad = write_jsonl(tmp_path / "b.jsonl", [{"text": "ok"}, "{not json"])
    with pytest.raises(ValueError, match=r"b\.jsonl:2: not valid JSON"):
        read_corpus(bad)
    no_text = write_jsonl(tmp_path / "n.jsonl", [{"title": "t"}])
    with pytest.raises(ValueError, match=r"n\.jsonl:1: a passage needs a string 'text'"):
        read_corpus(no_text)
    with pytest.raises(ValueError, match="topk"):
        SearchTool(str(flash), topk=0)
