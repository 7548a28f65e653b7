"""The lm-eval backend's scoring (nnx_surgery/evaluation/lm_eval_backend.py), apart from lm-eval itself: the jitted functions
that turn padded batches of requests into log-likelihoods and greedy flags, and the length buckets that keep their
shapes few (each (batch, bucket) compiles once).
"""
from __future__ import annotations

import functools
import itertools
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

SMALLEST_BUCKET = 16
HEAD_ELEMENTS = 2 ** 26  # logits the scorer holds at once (256 MiB in float32): 256 positions of a 262k vocabulary


@functools.partial(jax.jit, static_argnames=("graphdef",))
def score_batch(graphdef, state, ids, scored, targets, picks, valid):
    """Per row: the summed log-probability of `targets` (B, K) predicted at positions `scored` (B, K), over the
    real ones (`picks`/`valid`, `head_scores`), and whether each is the argmax. Only those go through the LM head:
    in a small Gemma the head is most of the work (Gemma 3 270M: 168M of 268M parameters), and a multiple-choice
    continuation is a few tokens after a long context. Right padding needs no mask: a causal model's earlier
    positions never see it."""
    model = nnx.merge(graphdef, state)
    hidden = model(ids, return_logits=False).final_hidden
    return head_scores(model, jnp.take_along_axis(hidden, scored[..., None], axis=1), targets, picks, valid)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def score_shared_contexts(graphdef, state, contexts, context_mask, inputs, targets, picks, valid):
    """Requests that share their context (a multiple-choice question's choices): each context (B, W, left-padded,
    `context_mask`) runs once into a KV cache, then its C continuations continue copies of it in one call; `inputs`
    (B, C, K - 1) are a continuation's tokens but its last (right-padded), `targets` (B, C, K) what is scored
    (`picks`/`valid` as `head_scores` takes them, over the (B * C, K) positions). The context's last position
    predicts a continuation's first token, the continuation's own positions the rest. Per (row, choice): the
    summed log-probability and the greedy flag, as `score_batch` gives them for context + continuation in one row,
    for a fraction of the decoder's work when contexts are long."""
    model = nnx.merge(graphdef, state)
    (batch, width), (_, choices, k) = contexts.shape, targets.shape
    out = model(contexts, attention_mask=context_mask, cache=model.init_cache(batch, width + k),
                return_logits=False)
    last = jnp.repeat(out.final_hidden[:, -1:], choices, axis=0)  # (B * C, 1, D), row b's choices together
    if k == 1:  # one-token continuations: the context alone predicts them
        hidden = last
    else:  # every choice of every row in one call: the cache's rows repeated once per choice
        cache = jax.tree.map(lambda leaf: jnp.repeat(leaf, choices, axis=0) if leaf.ndim else leaf, out.cache)
        tail = model(inputs.reshape(batch * choices, k - 1), cache=cache, return_logits=False).final_hidden
        hidden = jnp.concatenate([last, tail], axis=1)
    totals, greedy = head_scores(model, hidden, targets.reshape(-1, k), picks, valid)
    return totals.reshape(batch, choices), greedy.reshape(batch, choices)


def head_scores(model, picked_hidden, targets, picks, valid):
    """(R, K, D) hidden states at the positions that predict `targets` (R, K) -> per row the summed
    log-probability of its targets and whether each is the argmax, over the positions `picks` (N,) of the
    flattened (R * K) grid where `valid` (N,) is 1: the real ones (`picks_of`), so the padding of short
    continuations to K never goes through the head. The head runs over at most HEAD_ELEMENTS logits at a time (a
    rolling window scores every position: 16 rows of 1,536 positions over 262k pieces would be 26 GB of logits)."""
    (rows, k, width), vocab, count = picked_hidden.shape, model.config.vocab_size, picks.shape[0]
    chunk = max(1, min(count, HEAD_ELEMENTS // vocab))
    pad = -count % chunk
    flat_hidden = jnp.pad(picked_hidden.reshape(rows * k, width)[picks], ((0, pad), (0, 0))).reshape(-1, chunk, width)
    flat_targets = jnp.pad(targets.reshape(rows * k)[picks], (0, pad)).reshape(-1, chunk)

    def head(part):
        part_hidden, part_targets = part
        logits = model.logits_from_hidden(part_hidden)
        picked = jnp.take_along_axis(logits, part_targets[:, None], axis=-1)[:, 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == part_targets

    logprobs, hits = (a.reshape(-1)[:count] for a in jax.lax.map(head, (flat_hidden, flat_targets)))
    owners = picks // k
    totals = jax.ops.segment_sum(logprobs * valid, owners, num_segments=rows)
    misses = jax.ops.segment_sum(jnp.where(valid > 0, ~hits, False).astype(jnp.int32), owners, num_segments=rows)
    return totals, misses == 0


def picks_of(weights) -> tuple:
    """The flat indices of `weights`' ones (numpy, any shape), padded with index 0 and `valid` 0 to a length
    bucket (`count_bucket`), so that few shapes compile: (picks int32, valid float32)."""
    found = np.flatnonzero(np.asarray(weights).reshape(-1) > 0).astype(np.int32)
    size = count_bucket(len(found))
    picks, valid = np.zeros(size, np.int32), np.zeros(size, np.float32)
    picks[:len(found)], valid[:len(found)] = found, 1.0
    return picks, valid


def _bucket_sizes() -> Iterator[int]:
    """16, 24, 32, 48, 64, 96, ...: powers of two and 1.5 times them (at most a third of a bucket is padding)."""
    size = SMALLEST_BUCKET
    while True:
        yield size
        yield size * 3 // 2
        size *= 2


def count_bucket(count: int) -> int:
    """The smallest bucket size at or above `count`."""
    return next(bucket for bucket in _bucket_sizes() if bucket >= count)


def length_buckets(max_length: int) -> list[int]:
    """Padded lengths a batch may take: the bucket sizes below `max_length`, and `max_length` itself."""
    return list(itertools.takewhile(lambda bucket: bucket < max_length, _bucket_sizes())) + [max_length]


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= length)


def scoring_rows(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], int]:
    """The model's input (context + continuation without its last token, cut from the left to `max_length`, as
    the hf backend cuts it) and how many of its last positions predict the continuation."""
    tokens = (list(context) + list(continuation))[-(max_length + 1):]
    return tokens, len(continuation)
