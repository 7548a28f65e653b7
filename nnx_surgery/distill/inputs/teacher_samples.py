"""The teacher as k stratified draws from its distribution instead of its top k: a cache target whose expectation is
the full distribution (`CacheSettings(selection="sampled")`).

A top-k cache renormalises the teacher's k most likely pieces, so a student trained on it learns to give the rest
no mass, which held-out text then charges it for. Here each position stores the pieces that k draws from the
teacher's distribution landed on, each with its share of the draws (count / k) as its probability; the shares sum
to 1 (residual -inf). The cross-entropy against that target has the gradient q - p_hat, and E[p_hat] = p, so it is
the full-distribution gradient q - p in expectation (random-sampling distillation). The loss code is the top-k
path's, renormalised (it gives exactly the shares).

The draws are stratified: draw i is the piece at cumulative probability (i + u_i) / k, one uniform u_i per stratum.
Every piece's expected count is still k p, and its count lies within 2 of k p (independent draws spread
binomially: a piece of p = 1/2 could be drawn anywhere from 0 to k times). Like the top k, the draws stream over
the head's vocabulary chunks: a first pass gives the log-normaliser, a second the cumulative probabilities chunk
by chunk, where each draw finds its piece, so no (B, T, V) array exists. The uniforms come from the seed folded
with the packed row's index, so a row's draws do not depend on the batch, the mesh, the process count or a
resume.

`selection="mixed"` (`mixed_logprobs`) keeps the top k // 2 at their exact probabilities and draws the other slots
from the rest of the distribution (scaled by the rest's mass): still the full distribution in expectation, with the
randomness confined to the rest, which holds little of a trained LM's mass, so each token's target is nearer the
teacher than k pure draws (on a flat teacher it is not).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..interface import forward_inputs


def final_hidden_and_head(model: Any, batch: Mapping[str, jax.Array], vocab_chunk: int):
    """(the final hidden states (B, T, D), the head cut in chunks of `vocab_chunk` rows (n, C, D), zero-padded, and
    the vocabulary size) of the teacher on a batch: what the top k and the draws stream over."""
    hidden = model(batch["input_ids"], **forward_inputs(model, batch), return_logits=False).final_hidden
    head = model.head_matrix()
    vocab = head.shape[0]
    chunk = min(vocab_chunk, vocab)
    return hidden, jnp.pad(head, [(0, -vocab % chunk), (0, 0)]).reshape(-1, chunk, hidden.shape[-1]), vocab


def _normaliser(logits_fn: Callable, hidden: jax.Array, head_chunks: jax.Array, vocab_size: int):
    """(log-sum-exp, the most likely id) of hidden (R, D) against a head cut in chunks (n, C, D)."""
    chunk = head_chunks.shape[1]

    def step(carry, xs):
        lse, best, best_id = carry
        index, head = xs
        ids = index * chunk + jnp.arange(chunk, dtype=jnp.int32)
        logits = jnp.where(ids < vocab_size, logits_fn(hidden, head), -jnp.inf)
        top = jnp.max(logits, axis=-1)
        better = top > best  # the first chunk's maximum wins ties: the lower id
        best_id = jnp.where(better, index * chunk + jnp.argmax(logits, axis=-1).astype(jnp.int32), best_id)
        return (jnp.logaddexp(lse, jax.nn.logsumexp(logits, axis=-1)), jnp.maximum(best, top), best_id), None

    rows = hidden.shape[0]
    start = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
             jnp.zeros((rows,), jnp.int32))
    (lse, _, best_id), _ = jax.lax.scan(step, start, (jnp.arange(head_chunks.shape[0], dtype=jnp.int32),
                                                       head_chunks))
    return lse, best_id


def _draws(logits_fn: Callable, hidden: jax.Array, head_chunks: jax.Array, vocab_size: int,
           uniforms: jax.Array) -> jax.Array:
    """The ids (R, k) at cumulative probabilities `uniforms` (R, k) in [0, 1): the second pass."""
    chunk = head_chunks.shape[1]
    lse, best_id = _normaliser(logits_fn, hidden, head_chunks, vocab_size)

    def probabilities(index, head):
        ids = index * chunk + jnp.arange(chunk, dtype=jnp.int32)
        return jnp.where(ids < vocab_size, jnp.exp(logits_fn(hidden, head) - lse[:, None]), 0.0)

    drawn = _inverse_cdf(probabilities, head_chunks, uniforms)
    # a draw above the chunks' summed probabilities (their float32 total may round below 1) takes the likeliest
    return jnp.where(drawn < 0, best_id[:, None], drawn)


def _inverse_cdf(probabilities: Callable, head_chunks: jax.Array, targets: jax.Array) -> jax.Array:
    """The ids (R, n) where the running sum of `probabilities(chunk index, head chunk)` ((R, C) per chunk, over the
    chunks in order) passes each of `targets` (R, n); -1 where a target lies past their total."""
    chunk = head_chunks.shape[1]

    def step(carry, xs):
        start, drawn = carry
        index, head = xs
        cumulative = jnp.cumsum(probabilities(index, head), axis=-1)
        local = targets - start[:, None]
        here = (local >= 0.0) & (local < cumulative[:, -1:]) & (drawn < 0)
        found = jax.vmap(lambda c, u: jnp.searchsorted(c, u, side="right"))(cumulative, local)
        drawn = jnp.where(here, index * chunk + jnp.minimum(found, chunk - 1).astype(jnp.int32), drawn)
        return (start + cumulative[:, -1], drawn), None

    rows, n = targets.shape
    start = (jnp.zeros((rows,), jnp.float32), jnp.full((rows, n), -1, jnp.int32))
    (_, drawn), _ = jax.lax.scan(step, start, (jnp.arange(head_chunks.shape[0], dtype=jnp.int32), head_chunks))
    return drawn


def counted(drawn: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ids, log shares), each (R, k), of draws (R, k): every distinct drawn id once with log(count / k), the most
    drawn first (ties: the lower id); the slots left over repeat the first id with log share -inf."""
    rows, k = drawn.shape
    ordered = jnp.sort(drawn, axis=-1)
    new = jnp.concatenate([jnp.ones((rows, 1), bool), ordered[:, 1:] != ordered[:, :-1]], axis=-1)
    group = jnp.cumsum(new, axis=-1) - 1
    row = jnp.arange(rows)[:, None]
    counts = jnp.zeros((rows, k), jnp.int32).at[row, group].add(1)
    ids = jnp.zeros((rows, k), jnp.int32).at[row, group].set(ordered)
    counts, order = jax.lax.top_k(counts, k)  # ties keep the lower slot: the lower id
    ids = jnp.take_along_axis(ids, order, axis=-1)
    ids = jnp.where(counts > 0, ids, ids[:, :1])
    return ids, jnp.where(counts > 0, jnp.log(counts.astype(jnp.float32) / k), -jnp.inf)


def stratified_uniforms(seed: int, row_index: jax.Array, tokens: int, k: int) -> jax.Array:
    """(B, tokens, k) cumulative probabilities, ascending per token: (i + u_i) / k with u_i uniform, from `seed`
    folded with each row's packed index."""
    def one(row):
        u = jax.random.uniform(jax.random.fold_in(jax.random.key(seed), row), (tokens, k), jnp.float32)
        return (jnp.arange(k, dtype=jnp.float32) + u) / k
    return jax.vmap(one)(row_index)


def sampled_logprobs(model: Any, batch: Mapping[str, jax.Array], row_index: jax.Array, k: int, seed: int, *,
                     vocab_chunk: int = 8192, block_rows: int = 512) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As `topk_cache.topk_logprobs`, with the k slots holding the teacher's stratified draws (module docstring):
    ids (B, T, k) int32, log shares (B, T, k) float32, most drawn first, residual (B, T) -inf. `row_index` (B,):
    each row's packed index (its draws' key)."""
    hidden, head, vocab = final_hidden_and_head(model, batch, vocab_chunk)
    b, t, d = hidden.shape
    uniforms = stratified_uniforms(seed, row_index, t, k).reshape(b * t, k)
    rows = min(block_rows, b * t)
    fill = -(b * t) % rows
    blocks = jnp.pad(hidden.reshape(b * t, d), [(0, fill), (0, 0)]).reshape(-1, rows, d)
    u_blocks = jnp.pad(uniforms, [(0, fill), (0, 0)]).reshape(-1, rows, k)
    drawn = jax.lax.map(lambda x: _draws(model.logits_from_hidden, x[0], head, vocab, x[1]), (blocks, u_blocks))
    ids, logprobs = counted(drawn.reshape(-1, k)[:b * t])
    return ids.reshape(b, t, k), logprobs.reshape(b, t, k), jnp.full((b, t), -jnp.inf, jnp.float32)


# ------------------------------------------------------------------------------------------------ mixed
def _head(logits_fn: Callable, hidden: jax.Array, head_chunks: jax.Array, vocab_size: int, m: int):
    """(the m + 1 largest logits (R, m + 1), their ids, log-sum-exp (R,)) of hidden (R, D): the first pass."""
    chunk = head_chunks.shape[1]

    def step(carry, xs):
        best, best_ids, lse = carry
        index, head = xs
        ids = index * chunk + jnp.arange(chunk, dtype=jnp.int32)
        logits = jnp.where(ids < vocab_size, logits_fn(hidden, head), -jnp.inf)
        lse = jnp.logaddexp(lse, jax.nn.logsumexp(logits, axis=-1))
        values, where = jax.lax.top_k(logits, min(m + 1, chunk))
        merged, order = jax.lax.top_k(jnp.concatenate([best, values], -1), m + 1)  # lower ids win ties
        return (merged, jnp.take_along_axis(jnp.concatenate([best_ids, ids[where]], -1), order, -1), lse), None

    rows = hidden.shape[0]
    start = (jnp.full((rows, m + 1), -jnp.inf, jnp.float32), jnp.zeros((rows, m + 1), jnp.int32),
             jnp.full((rows,), -jnp.inf, jnp.float32))
    (values, ids, lse), _ = jax.lax.scan(step, start, (jnp.arange(head_chunks.shape[0], dtype=jnp.int32),
                                                       head_chunks))
    return values, ids, lse


def _tail_draws(logits_fn: Callable, hidden: jax.Array, head_chunks: jax.Array, vocab_size: int, m: int,
                uniforms: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(the top m's ids and log-probabilities (R, m), the ids drawn from the rest (R, n), the rest's mass (R,)):
    `uniforms` (R, n) are cumulative shares of the rest, in [0, 1)."""
    chunk = head_chunks.shape[1]
    values, top_ids, lse = _head(logits_fn, hidden, head_chunks, vocab_size, m)
    logprobs = values[:, :m] - lse[:, None]
    rest = jnp.clip(1.0 - jnp.sum(jnp.exp(logprobs), axis=-1), 0.0, 1.0)
    rows = jnp.arange(hidden.shape[0])[:, None]

    def rest_probabilities(index, head):
        ids = index * chunk + jnp.arange(chunk, dtype=jnp.int32)
        # The top m are excluded by their ids, never by comparing logits: this pass recomputes them, and how XLA
        # compiles the two passes can round a logit tied with the m-th differently, which let a draw repeat an id.
        local = top_ids[:, :m] - index * chunk
        taken = jnp.zeros((hidden.shape[0], chunk), bool).at[rows, jnp.where((local >= 0) & (local < chunk), local,
                                                                            chunk)].set(True, mode="drop")
        return jnp.where((ids < vocab_size) & ~taken, jnp.exp(logits_fn(hidden, head) - lse[:, None]), 0.0)

    drawn = _inverse_cdf(rest_probabilities, head_chunks, uniforms * rest[:, None])
    # a draw past the rest's float32 total takes the likeliest piece outside the top m
    return top_ids[:, :m], logprobs, jnp.where(drawn < 0, top_ids[:, m:], drawn), rest


def mixed_logprobs(model: Any, batch: Mapping[str, jax.Array], row_index: jax.Array, k: int, seed: int, *,
                   vocab_chunk: int = 8192, block_rows: int = 512) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As `sampled_logprobs`, with the first k // 2 slots holding the teacher's top k // 2 at their exact
    log-probabilities and the other slots the pieces that k - k // 2 stratified draws from the rest of the
    distribution landed on, each with the rest's mass times its share of those draws. The target's expectation is
    still the full distribution, and only the rest is random: the likeliest pieces, which carry most of the
    gradient, are exact (the variance of pure draws is in them)."""
    m = k // 2
    hidden, head, vocab = final_hidden_and_head(model, batch, vocab_chunk)
    b, t, d = hidden.shape
    uniforms = stratified_uniforms(seed, row_index, t, k - m).reshape(b * t, k - m)
    rows = min(block_rows, b * t)
    fill = -(b * t) % rows
    blocks = jnp.pad(hidden.reshape(b * t, d), [(0, fill), (0, 0)]).reshape(-1, rows, d)
    u_blocks = jnp.pad(uniforms, [(0, fill), (0, 0)]).reshape(-1, rows, k - m)
    top_ids, top_logprobs, drawn, rest = jax.lax.map(
        lambda x: _tail_draws(model.logits_from_hidden, x[0], head, vocab, m, x[1]), (blocks, u_blocks))
    drawn_ids, shares = counted(drawn.reshape(-1, k - m)[:b * t])
    rest = rest.reshape(-1)[:b * t, None]
    ids = jnp.concatenate([top_ids.reshape(-1, m)[:b * t], drawn_ids], axis=-1)
    logprobs = jnp.concatenate([top_logprobs.reshape(-1, m)[:b * t],
                                jnp.where(rest > 0, shares + jnp.log(jnp.maximum(rest, 1e-30)), -jnp.inf)], axis=-1)
    return ids.reshape(b, t, k), logprobs.reshape(b, t, k), jnp.full((b, t), -jnp.inf, jnp.float32)


def sampled_function(model: Any, k: int, seed: int, mixed: bool = False,
                     **settings) -> Callable[..., tuple[np.ndarray, ...]]:
    """`sampled_logprobs` of `model` (`mixed_logprobs` when `mixed`), jitted once: (batch, row_index) -> host
    arrays."""
    graphdef, state = nnx.split(model)
    slots = mixed_logprobs if mixed else sampled_logprobs
    compiled = jax.jit(lambda s, batch, rows: slots(nnx.merge(graphdef, s), batch, rows, k, seed, **settings))
    return lambda batch, rows: tuple(np.asarray(x) for x in compiled(state, batch, jnp.asarray(rows, jnp.int32)))


__all__ = ["counted", "mixed_logprobs", "sampled_function", "sampled_logprobs", "stratified_uniforms"]
