"""Degeneration of greedy continuations: how often a model loops, and how varied its text is.

A small student that has lost the teacher's ability to go on tends to repeat itself in greedy decoding
(`print(folder)` seven times). Per-token scores (CE, KL) and overlap scores (BLEU, ROUGE-L) see that only
indirectly, so the suite reports two direct measures over a model's continuations of the held-out prompts:

    loop_share   the share of continuations in which some n-gram (n = 4) occurs `times` (3) times or more
    distinct_2   distinct bigrams / all bigrams, pooled over the continuations (Li et al. 2016's distinct-n)

Both count words and single punctuation marks of the decoded text (`text_units`), not model tokens, so students
with a trimmed vocabulary and their teacher are measured in the same units. The teacher is the reference row:
code repeats itself legitimately (`self.x = x` lines), so a student is judged against the teacher's own share.
An empty continuation has no loop and no bigram; `distinct_2` is None when no continuation has a bigram.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Sequence


def text_units(text: str) -> list[str]:
    """Words and single punctuation marks, case kept (the units both measures count)."""
    return re.findall(r"\w+|[^\w\s]", text)


def ngrams(units: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(units[i:i + n]) for i in range(len(units) - n + 1)]


def has_loop(text: str, *, n: int = 4, times: int = 3) -> bool:
    """Whether some n-gram of `text`'s units occurs `times` times or more (overlapping occurrences count)."""
    if n < 1 or times < 2:
        raise ValueError(f"has_loop: n={n}, times={times}; use n >= 1 and times >= 2.")
    counts = collections.Counter(ngrams(text_units(text), n))
    return bool(counts) and max(counts.values()) >= times


def distinct_n(texts: Sequence[str], n: int = 2) -> float | None:
    """Distinct n-grams over all n-grams, pooled over `texts` (None when they hold no n-gram)."""
    pooled = [gram for text in texts for gram in ngrams(text_units(text), n)]
    return len(set(pooled)) / len(pooled) if pooled else None


@dataclasses.dataclass(frozen=True)
class LoopRule:
    """What counts as a loop: some `n`-gram `times` times or more in one continuation."""

    n: int = 4
    times: int = 3

    def describe(self) -> str:
        return f"some {self.n}-gram {self.times}+ times"


def degeneration(texts: Sequence[str], rule: LoopRule = LoopRule()) -> dict:
    """{"loop_share", "distinct_2", "continuations"} of one model's continuations (`loop_share` None for none)."""
    loops = [has_loop(text, n=rule.n, times=rule.times) for text in texts]
    return {"loop_share": sum(loops) / len(loops) if loops else None, "distinct_2": distinct_n(texts, 2),
            "continuations": len(texts)}


__all__ = ["text_units", "ngrams", "has_loop", "distinct_n", "LoopRule", "degeneration"]
