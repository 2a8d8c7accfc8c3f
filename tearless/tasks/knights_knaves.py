"""Knights and knaves (the Logic-RL task): who always tells the truth, and who always lies?

**Puzzles.** Each of N inhabitants makes one statement: a random logical formula of depth ≤ 2 over
the atoms "X is a knight" / "X is a knave", with not, and, or (two operands), if-then and
if-and-only-if. A person never says "I am a knave" (no consistent assignment exists), and no
operator joins two atoms about the same person ("X is a knight or X is a knave" says nothing). An assignment
(knight = True) is consistent when every speaker's statement is true exactly when the speaker is a
knight; the solver tries all 2^N assignments, and only puzzles with exactly one are kept.

**Format.** The response reasons in ``<think>…</think>`` and answers in ``<answer>…</answer>``,
listing every person, e.g. ``<answer>(1) Zoey is a knave (2) Oliver is a knight</answer>``. The
ground truth is the same list, one person per line: ``"(1) Zoey is a knave\\n(2) Oliver is a knight"``.

**Reward** (Logic-RL's values, the defaults; each is a keyword argument):

- format: +1 when each of the four tags occurs exactly once and in order (text may surround them,
  :func:`tearless.rewards.format.check_r1_format` with ``strict=False``), else -1;
- answer, read only when the format passed: +2 when every person's role is right; -1.5 when the
  answer names a role for everyone but some are wrong; -2 when it cannot be read (a person is
  missing, or the number of "knight"/"knave" words differs from N), or the format failed.

So the total is +3 (correct), -0.5 (well-formed, wrong), -1 (well-formed, unreadable) or -3 (broken
format). The result also has ``format``, ``answer`` and ``acc`` (1.0 when correct).
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

from tearless.rewards.format import check_r1_format, extract_answer

DATA_SOURCE = "knights_knaves"
NAMES = (
    "Zoey", "Oliver", "Mia", "Liam", "Ava", "Noah", "Emma", "Ethan", "Sofia", "Lucas", "Chloe", "Henry",
    "Grace", "Jack", "Lily", "Owen", "Ruby", "Leo", "Nora", "Samuel", "Hazel", "David", "Aurora",
    "Isaac", "Violet", "Caleb", "Stella", "Miles", "Ella", "Hugo", "Alice", "Felix", "Iris", "Jasper",
    "Maya", "Oscar", "Clara", "Elijah", "Luna", "Gabriel",
)  # fmt: skip
SPEECH = (
    '{name} says, "{s}."',
    "{name} claims that {s}.",
    'In {name}\'s words: "{s}."',
    "{name} tells you that {s}.",
    "According to {name}, {s}.",
    '"{S}," says {name}.',
    "{name} states that {s}.",
    "{name} remarks that {s}.",
)
INSTRUCTION = (
    "Think the puzzle through inside <think> </think>, then give the answer inside <answer> </answer>, "
    "naming each person's identity one by one, for example <answer> (1) Zoey is a knight\n"
    "(2) Oliver is a knave </answer>."
)
_ROLE_WORD = re.compile(r"\bkn(?:ight|ave)s?\b", re.IGNORECASE)
_TRUTH_LINE = re.compile(r"\(\d+\)\s*(.+?)\s+is\s+an?\s+(knight|knave)\b", re.IGNORECASE)

# A statement is a nested tuple: ("knight", i) | ("knave", i) | ("not", s) | ("and", s, t) |
# ("or", s, t) | ("->", s, t) | ("<->", s, t), where i is a person's index.
Statement = tuple


def holds(statement: Statement, knights: tuple[bool, ...]) -> bool:
    """The truth of ``statement`` when person i is a knight iff ``knights[i]``."""
    op = statement[0]
    if op == "knight":
        return knights[statement[1]]
    if op == "knave":
        return not knights[statement[1]]
    if op == "not":
        return not holds(statement[1], knights)
    a, b = holds(statement[1], knights), holds(statement[2], knights)
    return {"and": a and b, "or": a or b, "->": (not a) or b, "<->": a == b}[op]


def solve(statements: list[Statement]) -> list[tuple[bool, ...]]:
    """Every consistent assignment, by brute force over all 2^N (knight = True)."""
    n = len(statements)
    return [
        knights
        for knights in itertools.product((True, False), repeat=n)
        if all(knights[i] == holds(s, knights) for i, s in enumerate(statements))
    ]


def random_statement(rng: random.Random, n: int, speaker: int, depth: int = 2) -> Statement:
    """A random formula of at most ``depth`` levels of operators; never "I am a knave"."""
    while True:
        statement = _draw(rng, n, depth)
        if statement != ("knave", speaker):
            return statement


def _draw(rng: random.Random, n: int, depth: int) -> Statement:
    if depth == 0 or rng.random() < 0.3:
        return (rng.choice(("knight", "knave")), rng.randrange(n))
    op = rng.choice(("not", "and", "or", "->", "<->"))
    if op == "not":
        return ("not", _draw(rng, n, depth - 1))
    while True:
        a, b = _draw(rng, n, depth - 1), _draw(rng, n, depth - 1)
        # "X is a knight or X is a knave" and the like are constant: they say nothing.
        if not (a[0] in ("knight", "knave") and b[0] in ("knight", "knave") and a[1] == b[1]):
            return (op, a, b)


def make_puzzle(rng: random.Random, num_people: int, depth: int = 2) -> dict:
    """A puzzle with exactly one solution: names, statements and the solution (knight = True)."""
    names = rng.sample(NAMES, num_people)
    while True:
        statements = [random_statement(rng, num_people, i, depth) for i in range(num_people)]
        found = solve(statements)
        if len(found) == 1:
            return {"names": names, "statements": statements, "solution": list(found[0])}


def render_statement(statement: Statement, names: list[str]) -> str:
    """English for a formula; compound operands are parenthesised, so the reading is unambiguous."""
    op = statement[0]
    if op in ("knight", "knave"):
        return f"{names[statement[1]]} is a {op}"
    parts = [_operand(s, names) for s in statement[1:]]
    if op == "not":
        return f"it is not the case that {parts[0]}"
    if op == "->":
        return f"if {parts[0]} then {parts[1]}"
    if op == "<->":
        return f"{parts[0]} if and only if {parts[1]}"
    return f" {op} ".join(parts)


def _operand(statement: Statement, names: list[str]) -> str:
    text = render_statement(statement, names)
    return text if statement[0] in ("knight", "knave") else f"({text})"


def solution_text(names: list[str], solution: list[bool]) -> str:
    """The ground truth: ``"(1) Zoey is a knight\\n(2) Oliver is a knave"``."""
    return "\n".join(
        f"({i}) {name} is a {'knight' if knight else 'knave'}"
        for i, (name, knight) in enumerate(zip(names, solution, strict=True), start=1)
    )


def puzzle_text(puzzle: dict, rng: random.Random) -> str:
    """The puzzle as prose: the island, the inhabitants, one sentence per statement, the question."""
    names = puzzle["names"]
    lines = [
        "A very special island is inhabited only by knights and knaves. Knights always tell the truth, "
        f"and knaves always lie. You meet {len(names)} inhabitants: {', '.join(names[:-1])} and "
        f"{names[-1]}."
    ]
    for name, statement in zip(names, puzzle["statements"], strict=True):
        s = render_statement(statement, names)
        lines.append(rng.choice(SPEECH).format(name=name, s=s, S=s[:1].upper() + s[1:]))
    lines.append("So who is a knight and who is a knave?")
    return " ".join(lines)


def to_row(puzzle: dict, text: str, split: str, index: int) -> dict:
    """A veRL-schema row: the instruction as the system message, the puzzle as the user turn."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": text}],
        "ability": "logic",
        "reward_model": {"style": "rule", "ground_truth": solution_text(puzzle["names"], puzzle["solution"])},
        "extra_info": {"split": split, "index": index, "num_people": len(puzzle["names"])},
    }


def generate_rows(
    num: int, *, seed: int, split: str, num_people: int = 3, depth: int = 2, exclude: set | None = None
) -> list[dict]:
    """``num`` distinct puzzles (by statements), none in ``exclude``, which grows."""
    if not 2 <= num_people <= len(NAMES):
        raise ValueError(f"num_people must be in [2, {len(NAMES)}], got {num_people}")
    rng = random.Random(seed)
    seen = exclude if exclude is not None else set()
    rows: list[dict] = []
    for _ in range(100 * num + 100):
        puzzle = make_puzzle(rng, num_people, depth)
        key = tuple(puzzle["statements"])
        if key not in seen:
            seen.add(key)
            rows.append(to_row(puzzle, puzzle_text(puzzle, rng), split, len(rows)))
            if len(rows) == num:
                return rows
    raise ValueError(f"could not draw {num} distinct {num_people}-person puzzles")


def parse_roles(text: str, names: list[str]) -> dict[str, bool] | None:
    """Each name's role (knight = True) as the text states it, or ``None`` if it cannot be read.

    The first "knight"/"knave" after each name on the same line counts, and the text must hold
    exactly one such word per person.
    """
    if len(_ROLE_WORD.findall(text)) != len(names):
        return None
    roles = {}
    for name in names:
        match = re.search(rf"\b{re.escape(name)}\b.*?\bkn(ight|ave)\b", text, re.IGNORECASE)
        if match is None:
            return None
        roles[name] = match.group(1).lower() == "ight"
    return roles


def parse_ground_truth(ground_truth: str) -> dict[str, bool]:
    """``{name: knight?}`` from a ground truth made by :func:`solution_text`."""
    roles = {name: role.lower() == "knight" for name, role in _TRUTH_LINE.findall(ground_truth)}
    if not roles:
        raise ValueError(
            f"a knights-and-knaves ground truth lists '(1) NAME is a knight|knave', got {ground_truth!r:.80}"
        )
    return roles


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_reward: float = 1.0,
    format_penalty: float = -1.0,
    correct_reward: float = 2.0,
    wrong_penalty: float = -1.5,
    unreadable_penalty: float = -2.0,
) -> dict[str, float]:
    """Format score + answer score (see the module docs)."""
    truth = parse_ground_truth(str(ground_truth))
    answer = extract_answer(solution_str)
    well_formed = check_r1_format(solution_str, strict=False) and answer is not None
    roles = parse_roles(answer, list(truth)) if well_formed else None
    correct = roles == truth
    if roles is None:
        answer_score = unreadable_penalty
    else:
        answer_score = correct_reward if correct else wrong_penalty
    format_score = format_reward if well_formed else format_penalty
    return {
        "score": format_score + answer_score,
        "format": format_score,
        "answer": answer_score,
        "acc": float(correct),
    }
