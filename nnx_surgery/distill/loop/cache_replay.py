"""Training from a teacher cache (issue 42): `distill.run(None, student, data, DistillConfig(teacher_cache=...))`.

The cache (`distill.inputs.topk_cache`, written by `nnx-surgery cache-teacher`) holds every packed training row with
the teacher's top k beside it, so the teacher is never loaded: `CachedTeacherData` is the run's data stream (the
cache's rows in `TokenBatches`'s order, with `topk_ids`, `topk_logprobs` and `residual` in each batch) and the
step's logit term reads them through the same top-k loss code as an online top-k run (`distill.losses.topk_teacher`).

The stream starts where the `data` given beside the cache stands (its epoch and position; the start without it).
`prepare_cached_run` checks the run against the cache before anything trains, each refusal one line: sequence length,
vocabulary (the student's head against the cache's, and a trimmed student's map against the one the cache was
written in: `cache-teacher --student` writes a cache in a trimmed student's tokens), the packing of the `data`
given alongside (its seed, rows and their fingerprint), k (`top_k` None takes the cache's k; a smaller `top_k`
reads the first k of the cached ones, which are sorted; a larger one is refused; a cache of draws,
`selection="sampled"`, is read whole and renormalised), and the terms: only the logit term's kinds can be
computed, as the cache holds no hidden states or attention maps (and no full logits: `train_diagnostics` is
refused).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ..losses import term_registry as terms
from ..inputs.cache_format import CacheError
from ..inputs.batches import RowStream, changed_identity
from ..losses.logit_term import LOGIT
from ..inputs.topk_cache import DRAWN, TeacherCache, next_rows, slots_text, vocab_map_sha256
from ..trimmed_vocab import vocab_map_of


class CachedTeacherData(RowStream):
    """The data stream of a cache run: `next_batch()` gives `batch_size` rows (this process's share of them) in
    `TokenBatches.next_batch`'s order, `state()` / `restore()` use `TokenBatches.state()`'s record (so a
    checkpoint of a cache run resumes at the same row, and carries the packing's fingerprint), and
    `eval_batches()` are those of the data given beside the cache (none without it)."""

    def __init__(self, cache: TeacherCache, batch_size: int, *, eval_source: Any = None,
                 process_index: int | None = None, process_count: int | None = None):
        self.cache, self.batch_size, self.eval_source = cache, batch_size, eval_source
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if batch_size % self.process_count:
            raise CacheError(f"batch_size {batch_size} must split evenly over {self.process_count} processes.")
        self.num_rows, self.seed = cache.num_rows, cache.packing.get("seed")
        self.fingerprint = cache.packing.get("fingerprint")
        self.epoch = self.position = 0
        self._orders: dict[int, np.ndarray] = {}

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            self._orders = {epoch: self.cache.order(epoch)}
        return self._orders[epoch]

    def next_batch(self) -> dict[str, np.ndarray]:
        index, self.epoch, self.position = next_rows(self._order, self.num_rows, self.epoch, self.position,
                                                     self.batch_size)
        per = self.batch_size // self.process_count
        return self.cache.rows(index[self.process_index * per:(self.process_index + 1) * per])

    def __iter__(self):
        while True:
            yield self.next_batch()

    def restore(self, state: dict[str, Any]) -> None:
        for key, saved, ours in changed_identity(self, state):
            raise CacheError(f"cannot resume from teacher cache {self.cache.folder}: the checkpoint's data has "
                             f"{key}={saved!r}, the cache's {ours!r}; resume with the cache the run started from.")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

    def eval_batches(self) -> list[dict[str, np.ndarray]]:
        source = getattr(self.eval_source, "eval_batches", None)
        return list(source()) if callable(source) else []


def _check_terms(config: Any) -> None:
    """Only the logit term's kinds: the cache holds no hidden states, attention maps or full logits."""
    for index, stage in enumerate(config.stages):
        needy = [t.name for t in terms.active_terms(stage.weights) if t is not LOGIT]
        if needy:
            raise CacheError(f"teacher_cache {config.teacher_cache}: stage {stage.name or index} weights {needy}, "
                             "which read the teacher's hidden states or attention maps, and a teacher cache holds "
                             "only its top-k distribution; set those weights to 0 or train with the teacher.")
    if config.train_diagnostics:
        raise CacheError(f"teacher_cache {config.teacher_cache}: train_diagnostics needs the teacher's full logits, "
                         "which a teacher cache does not hold; set train_diagnostics=False.")
    if config.on_policy.fraction:
        raise CacheError(f"teacher_cache {config.teacher_cache}: on-policy steps need the teacher to score the "
                         "student's samples; set on_policy.fraction=0 or train with the teacher.")


def _check_vocabulary(cache: TeacherCache, config: Any, student_rows: int) -> None:
    """The cache is in the student's vocabulary: the teacher's (no map on either side), or the same trimmed
    vocabulary (the run's vocab_map, or its plan's kept_vocab, is the one the cache was written with)."""
    mapped = vocab_map_of(config)
    saved, ours = cache.manifest["identity"].get("vocab_map_sha256"), vocab_map_sha256(mapped)
    if saved != ours:
        pieces = len(mapped) if mapped is not None else 0
        if saved and ours:
            why = f"made in another trimmed vocabulary than the run's student's ({pieces:,} pieces)"
        elif saved:
            why = "made in a trimmed student's vocabulary, but the run's student has the teacher's"
        else:
            why = f"made in the teacher's vocabulary, but the run's student has a trimmed one ({pieces:,} pieces)"
        raise CacheError(f"teacher cache {cache.folder}: {why}; write the cache for this student (`nnx-surgery "
                         "cache-teacher TEACHER --student STUDENT`).")
    if student_rows != cache.vocab_size:
        raise CacheError(f"teacher cache {cache.folder}: made over a {cache.vocab_size:,}-piece vocabulary, the "
                         f"student's head has {student_rows:,} rows; write the cache for this student "
                         "(`nnx-surgery cache-teacher TEACHER --student STUDENT`).")


def _check_sampled(cache: TeacherCache, config: Any) -> None:
    """A cache of k draws (`teacher_samples`) is read whole and renormalised: its shares are the target."""
    if config.top_k is not None and config.top_k != cache.top_k:
        raise CacheError(f"teacher cache {cache.folder}: holds {slots_text(cache.selection, cache.top_k)} of "
                         f"the teacher's distribution, not its top k; the run asks top_k={config.top_k}, and the "
                         f"first {config.top_k} slots would no longer average to the teacher: give "
                         f"top_k={cache.top_k} (or None).")
    if config.top_k_mode != "renormalised":
        raise CacheError(f"teacher cache {cache.folder}: holds draws whose shares sum to 1, so top_k_mode="
                         f"{config.top_k_mode!r} has no residual to read; set top_k_mode='renormalised'.")


def _check_packing(cache: TeacherCache, data: Any) -> None:
    """The data given beside the cache (its held-out batches and batch size) must be the packing it was made of."""
    if data is None or not hasattr(data, "fingerprint"):
        return
    cache.check_matches(seq_len=data.seq_len, seed=data.seed, rows=data.num_rows, fingerprint=data.fingerprint)


def prepare_cached_run(config: Any, student: Any, data: Any = None, *, cache: TeacherCache | None = None,
            tokenizer_hash: str | None = None) -> tuple[Any, CachedTeacherData]:
    """(config with its top_k resolved, the run's data stream) of a run from `config.teacher_cache`, after every
    check of the module docstring (CacheError, one line). `data`: optional, the run's TokenBatches (its packing
    is checked and its held-out batches are used); `tokenizer_hash`: the sha256 of the student's tokenizer file
    (checked against the cache's when both are known)."""
    cache = cache or TeacherCache.open(config.teacher_cache)
    _check_terms(config)
    _check_vocabulary(cache, config, int(student.head_matrix().shape[0]))
    if config.top_k is not None and config.top_k > cache.top_k:
        raise CacheError(f"teacher cache {cache.folder}: holds the top {cache.top_k}, the run asks top_k="
                         f"{config.top_k}; give top_k <= {cache.top_k} (or None) or write a cache with more.")
    if cache.selection in DRAWN:
        _check_sampled(cache, config)
    cache.check_matches(seq_len=config.seq_len, tokenizer_hash=tokenizer_hash)
    _check_packing(cache, data)
    batch_size = config.batch_size or getattr(data, "batch_size", None)
    if not batch_size:
        raise CacheError(f"teacher cache {cache.folder}: set DistillConfig.batch_size (the cache's rows are "
                         "served in batches of it).")
    config = dataclasses.replace(config, top_k=config.top_k or cache.top_k,
                                 seq_len=config.seq_len or cache.seq_len, batch_size=batch_size)
    stream = CachedTeacherData(cache, batch_size, eval_source=data)
    if callable(getattr(data, "state", None)) and hasattr(data, "fingerprint"):
        stream.restore(data.state())  # read on from where the data given beside the cache stands
    return config, stream


__all__ = ["CachedTeacherData", "prepare_cached_run"]
