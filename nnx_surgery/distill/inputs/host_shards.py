"""Multi-host tokenisation: each process tokenises only its share of the documents (every `process_count`-th,
from its `process_index`), then the token ids are gathered over JAX's multi-controller runtime so that every
process holds all of them and walks the same global row order a single process would. The data position in a
checkpoint, the held-out split and the calibration rows are therefore the same on every process (a checkpoint
resumes on any number of processes), while the tokenising, the slow part, is split between the hosts. Every
process still reads all the records (text is small next to the tokeniser's work).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

Document = tuple[np.ndarray, np.ndarray]  # (token ids, trainable-target flags)


def tokenize_shared(records: Sequence[Any], tokenizer: Any,
                    tokenize: Callable[[Sequence[Any], Any], list[Document]], process_count: int) -> list[Document]:
    """`tokenize(records, tokenizer)` for all records, each process tokenising records p, p + P, ... and the
    results gathered (a collective: every process calls it with the same records). One process, or a
    `process_count` that is not the runtime's (a pipeline built for one process's share by hand): plain
    `tokenize`."""
    import jax
    if process_count <= 1 or jax.process_count() != process_count:
        return tokenize(records, tokenizer)
    from jax.experimental import multihost_utils

    count, index = process_count, jax.process_index()
    local = tokenize([records[i] for i in range(index, len(records), count)], tokenizer)
    lengths = np.zeros(len(records), np.int64)
    lengths[index::count] = [len(ids) for ids, _ in local]
    lengths = np.asarray(multihost_utils.process_allgather(lengths)).sum(axis=0)  # (P, N) -> N, one owner each
    totals = [int(lengths[p::count].sum()) for p in range(count)]
    width = max(totals)
    packed = np.zeros((2, width), np.int32)  # row 0: ids, row 1: flags
    if local:
        packed[0, :totals[index]] = np.concatenate([ids for ids, _ in local])
        packed[1, :totals[index]] = np.concatenate([flags for _, flags in local])
    gathered = np.asarray(multihost_utils.process_allgather(packed))  # (P, 2, width)
    documents: list[Document | None] = [None] * len(records)
    for p in range(count):
        offset = 0
        for i in range(p, len(records), count):
            end = offset + int(lengths[i])
            documents[i] = (gathered[p, 0, offset:end].copy(), gathered[p, 1, offset:end].astype(bool))
            offset = end
    return documents  # type: ignore[return-value]


__all__ = ["tokenize_shared"]
