"""Local search: Okapi BM25 over a JSONL corpus, top-k passages with a length cap.

The index is built in memory when the tool is created (a few milliseconds per thousand passages), so
no service or extra dependency is needed. Scoring, for query terms q and a passage d of |d| terms
(average length avgdl over the corpus, N passages, n(q) passages containing q):

    score(d) = Σ_q IDF(q) · tf(q, d) · (k1 + 1) / (tf(q, d) + k1 · (1 − b + b · |d| / avgdl))
    IDF(q)   = ln(1 + (N − n(q) + 0.5) / (n(q) + 0.5))       (always > 0)

Terms are lower-cased runs of letters and digits. Ties are broken by corpus order, so results are
deterministic.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from collections import Counter, defaultdict
from pathlib import Path

from tearless.tools.base import Tool

_TERM = re.compile(r"[a-z0-9]+")


def terms(text: str) -> list[str]:
    """BM25 terms of ``text``: lower-cased runs of letters and digits."""
    return _TERM.findall(text.lower())


class BM25Index:
    """An inverted index over ``docs`` with Okapi BM25 scoring (see the module docstring)."""

    def __init__(self, docs: list[str], *, k1: float = 1.5, b: float = 0.75) -> None:
        if not docs:
            raise ValueError("BM25Index needs at least one document")
        self.k1, self.b = k1, b
        self.lengths = [0] * len(docs)
        self.postings: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for i, doc in enumerate(docs):
            counts = Counter(terms(doc))
            self.lengths[i] = sum(counts.values())
            for term, tf in counts.items():
                self.postings[term].append((i, tf))
        self.avgdl = max(sum(self.lengths) / len(docs), 1e-9)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5)) for t, p in self.postings.items()}

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """The ``k`` best (document index, score) pairs with a positive score, best first."""
        scores: dict[int, float] = defaultdict(float)
        for term in set(terms(query)):
            idf = self.idf.get(term)
            if idf is None:
                continue
            for doc, tf in self.postings[term]:
                norm = self.k1 * (1 - self.b + self.b * self.lengths[doc] / self.avgdl)
                scores[doc] += idf * tf * (self.k1 + 1) / (tf + norm)
        return heapq.nsmallest(k, ((d, s) for d, s in scores.items()), key=lambda x: (-x[1], x[0]))


def read_corpus(path: str | Path) -> list[dict]:
    """Passages of a JSONL corpus: each line ``{"text": ..., "title": ...}`` (title optional) or
    FlashRAG's ``{"contents": "\\"Title\\"\\ntext"}``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"search corpus {path} does not exist; point corpus_path at a JSONL file")
    passages = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text", row.get("contents")), str):
            raise ValueError(f"{path}:{lineno}: a passage needs a string 'text' (or 'contents') field")
        if "text" in row:
            passages.append({"title": str(row.get("title", "")), "text": row["text"]})
        else:
            title, _, text = row["contents"].partition("\n")
            passages.append({"title": title.strip('"'), "text": text})
    if not passages:
        raise ValueError(f"search corpus {path} has no passages")
    return passages


class SearchTool(Tool):
    """``search(query)``: the ``topk`` best BM25 passages of the corpus, one per line, each cut to
    ``max_passage_chars``. The title is indexed with the text (so a passage about X ranks first for
    the query X) but only the text is returned."""

    name = "search"
    description = "Search the knowledge base and return the most relevant passages."
    parameters = {  # noqa: RUF012
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to look up"}},
        "required": ["query"],
    }

    def __init__(self, corpus_path: str, topk: int = 3, max_passage_chars: int = 200) -> None:
        if topk < 1 or max_passage_chars < 1:
            raise ValueError(
                f"search tool: topk and max_passage_chars must be >= 1, got {topk}, {max_passage_chars}"
            )
        self.passages = read_corpus(corpus_path)
        self.index = BM25Index([f"{p['title']} {p['text']}" for p in self.passages])
        self.topk, self.max_passage_chars = topk, max_passage_chars

    def call(self, query: str) -> str:
        hits = self.index.search(query, self.topk)
        if not hits:
            return "no results"
        return "\n".join(self.passages[i]["text"][: self.max_passage_chars] for i, _ in hits)
