"""Ordered work-ahead: compute the next items in background threads while the caller consumes the current one.

Loading and writing checkpoints alternate between reading (`preadv`, releases the GIL), numpy work (mostly
releases it) and handing data on (jax, file writes). Overlapping them keeps both cores and the disk busy; the
bounded depth keeps host memory at the current item plus `depth` items in flight.
"""
from __future__ import annotations

import collections
import concurrent.futures
from typing import Callable, Iterable, Iterator, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


def work_ahead(items: Iterable[Item], work: Callable[[Item], Result], *, workers: int = 1,
               depth: int = 1) -> Iterator[tuple[Item, Result]]:
    """Yield `(item, work(item))` in the order of `items`; while the caller holds one result, `work` runs on up to
    `depth` following items on `workers` threads.

    An exception raised by `work` surfaces when its item's turn comes. Closing the generator early cancels the
    items that have not started. The generator drops its own reference to a result as soon as it has yielded it,
    so a caller that `del`s the result before asking for the next one holds at most `depth + 1` results."""
    if depth < 1 or workers < 1:
        raise ValueError(f"work_ahead needs depth >= 1 and workers >= 1, got depth={depth}, workers={workers}.")
    source = iter(items)
    pending: collections.deque = collections.deque()
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="surgery-ahead")
    try:
        for item in source:
            pending.append((item, pool.submit(work, item)))
            if len(pending) == depth:
                break
        while pending:
            item, future = pending.popleft()
            result = future.result()
            for following in source:  # one more in flight while the caller uses `result`
                pending.append((following, pool.submit(work, following)))
                break
            yield item, result
            del result, future
    finally:
        for _, future in pending:
            future.cancel()
        pool.shutdown(wait=True)
