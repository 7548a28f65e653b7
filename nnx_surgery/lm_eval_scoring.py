"""The lm-eval backend's scoring (nnx_surgery/lm_eval_backend.py), apart from lm-eval itself: the jitted functions
that turn padded batches of requests into log-likelihoods and greedy flags, and the length buckets that keep their
shapes few (each (batch, bucket) compiles once).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

SMALLEST_BUCKET = 16
HEAD_ELEMENTS = 2 ** 26  # logits the scorer holds at once (256 MiB in float32): 256 positions of a 262k vocabulary


@functools.partial(jax.jit, static_argnames=("graphdef",))
def score_batch(graphdef, state, ids, scored, targets, weights):
    """Per row: the summed log-probability of `targets` at positions `scored` (B, K) where `weights` is 1, and
    whether each of those targets is the argmax. Only the K scored positions go through the LM head: in a small
    Gemma the head is most of the work (Gemma 3 270M: 168M of 268M parameters), and a multiple-choice continuation
    is a few tokens after a long context. Right padding needs no mask: a causal model's earlier positions never
    see it."""
    model = nnx.merge(graphdef, state)
    hidden = model(ids, return_logits=False).final_hidden
    return head_scores(model, jnp.take_along_axis(hidden, scored[..., None], axis=1), targets, weights)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def score_shared_contexts(graphdef, state, contexts, context_mask, inputs, targets, weights):
    """Requests that share their context (a multiple-choice question's choices): each context (B, W, left-padded,
    `context_mask`) runs once into a KV cache, then each of C continuations continues that cache; `inputs`
    (B, C, K - 1) are a continuation's tokens but its last (right-padded), `targets`/`weights` (B, C, K) what is
    scored. The context's last position predicts a continuation's first token, the continuation's own positions
    the rest. Per (row, choice): the summed log-probability and the greedy flag, as `score_batch` gives them for
    context + continuation in one row, for a fraction of the decoder's work when contexts are long."""
    model = nnx.merge(graphdef, state)
    (batch, width), (_, choices, k) = contexts.shape, targets.shape
    out = model(contexts, attention_mask=context_mask, cache=model.init_cache(batch, width + k),
                return_logits=False)
    last = out.final_hidden[:, -1:]

    def one_choice(choice_inputs):
        if k == 1:  # one-token continuations: the context alone predicts them
            return last
        tail = model(choice_inputs, cache=out.cache, return_logits=False).final_hidden
        return jnp.concatenate([last, tail], axis=1)

    hidden = jnp.moveaxis(jax.lax.map(one_choice, jnp.moveaxis(inputs, 1, 0)), 0, 1)  # (B, C, K, D)
    totals, greedy = head_scores(model, hidden.reshape(batch * choices, k, -1), targets.reshape(-1, k),
                                  weights.reshape(-1, k))
    return totals.reshape(batch, choices), greedy.reshape(batch, choices)


def head_scores(model, picked_hidden, targets, weights):
    """(B, K, D) hidden states at the scored positions -> per row the summed log-probability of `targets` where
    `weights` is 1 and whether each is the argmax. The head runs over at most HEAD_ELEMENTS logits at a time (a
    rolling window scores every position: 16 rows of 1,536 positions over 262k pieces would be 26 GB of logits)."""
    (batch, k, width), vocab = picked_hidden.shape, model.config.vocab_size
    rows, chunk = batch * k, max(1, min(batch * k, HEAD_ELEMENTS // vocab))
    pad = -rows % chunk
    flat_hidden = jnp.pad(picked_hidden.reshape(rows, width), ((0, pad), (0, 0))).reshape(-1, chunk, width)
    flat_targets = jnp.pad(targets.reshape(rows), (0, pad)).reshape(-1, chunk)

    def head(part):
        part_hidden, part_targets = part
        logits = model.logits_from_hidden(part_hidden)
        picked = jnp.take_along_axis(logits, part_targets[:, None], axis=-1)[:, 0]
        return picked - jax.nn.logsumexp(logits, axis=-1), jnp.argmax(logits, axis=-1) == part_targets

    logprobs, hits = jax.lax.map(head, (flat_hidden, flat_targets))
    logprobs, hits = (a.reshape(-1)[:rows].reshape(batch, k) for a in (logprobs, hits))
    return jnp.sum(logprobs * weights, axis=-1), jnp.all(hits | (weights == 0), axis=-1)


def length_buckets(max_length: int) -> list[int]:
    """Padded lengths a batch may take: 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5 times them: at most a
    third of a batch is padding), and `max_length` itself."""
    buckets, size = [], SMALLEST_BUCKET
    while size < max_length:
        buckets += [size] + ([size * 3 // 2] if size * 3 // 2 < max_length else [])
        size *= 2
    return buckets + [max_length]


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    return next(b for b in buckets if b >= length)


def scoring_rows(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], int]:
    """The model's input (context + continuation without its last token, cut from the left to `max_length`, as
    the hf backend cuts it) and how many of its last positions predict the continuation."""
    tokens = (list(context) + list(continuation))[-(max_length + 1):]
    return tokens, len(continuation)


# ------------------------------------------------------------------------------------------------ the model
