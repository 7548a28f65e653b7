"""Held-out language-model loss and perplexity of any model that follows the distill interface.

Batches are the data pipeline's dicts: `loss_mask[b, t]` weights the prediction of token t+1 at position t. A
batch of packed documents (`positions`, `segment_ids`) is scored document by document: attention stays inside a
document and no target crosses a boundary (`interface.next_token_targets`). Log-probabilities are computed from
final hidden states in row chunks through `model.logits_from_hidden`, so full (B, T, V) float32 logits never exist
for large vocabularies.

Multi-host (`jax.distributed`, several processes): every process calls these functions together with its own rows
of the same global batches (as `TokenBatches(process_index=, process_count=)` gives them, process 0's rows first);
`batch_arrays` assembles each global batch on the model's mesh, so every process computes the same global numbers
as one process given the whole batches. Rows that are the same on every process (`sequence_loglikelihoods`) go
onto the mesh as they are.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnx_surgery.distill.distributed import to_host
from nnx_surgery.distill.interface import FORWARD_KEYS, forward_inputs, next_token_targets
from nnx_surgery.distill.losses.divergence import row_blocks
from nnx_surgery.distill.mesh import batch_spec, put_batch, rows_stay_on_their_process


def token_logprobs(model: Any, batch: dict[str, jax.Array], chunk: int = 256) -> tuple[jax.Array, jax.Array]:
    """(log p(token t + 1 | tokens <= t), weight) per position, both (B, T) float32; traceable. The weight is
    `next_token_targets`'s (0 where the prediction is not scored; the log-probability there is meaningless)."""
    input_ids = batch["input_ids"]
    labels, weights, _ = next_token_targets(batch)
    out = model(input_ids, **forward_inputs(model, batch), return_logits=False)
    width = out.final_hidden.shape[-1]
    logprobs = target_logprobs(model, out.final_hidden.reshape(-1, width), labels.reshape(-1), chunk)
    return logprobs.reshape(input_ids.shape), weights


def target_logprobs(model: Any, hidden: jax.Array, targets: jax.Array, chunk: int = 256) -> jax.Array:
    """log p(target) for each row of (N, D) final hidden states, through the head in blocks of `chunk` rows."""
    head = model.head_matrix()

    def block(args):
        h, y = args
        logits = model.logits_from_hidden(h, head)
        return jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)

    logprobs = jax.lax.map(block, (row_blocks(hidden, chunk), row_blocks(targets, chunk)))
    return logprobs.reshape(-1)[:targets.size]


def model_mesh(model: Any) -> Mesh | None:
    """The mesh `model`'s arrays are placed on (their NamedSharding's), or None for a model on one device."""
    for leaf in jax.tree.leaves(nnx.state(model)):
        sharding = getattr(leaf, "sharding", None)
        # a placed array's mesh is concrete (an AbstractMesh only describes one)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh) and not sharding.mesh.empty:
            return sharding.mesh
    return None


def batch_arrays(batch: dict[str, Any], mesh: Mesh | None = None) -> dict[str, jax.Array]:
    """The keys a scoring forward reads, as device arrays (other keys of a pipeline batch are dropped).

    One process: the arrays as they are. Multi-host: `batch` is this process's rows of a global batch and the
    result is the global batch (a collective: every process calls it), on `mesh` (the model's) split over its
    data axes; without a mesh (a model copied whole onto each process's devices), every process gets all rows."""
    keys = [k for k in ("input_ids", "loss_mask", *FORWARD_KEYS) if k in batch]
    if jax.process_count() == 1:
        return {k: jnp.asarray(batch[k]) for k in keys}
    local = {k: np.asarray(batch[k]) for k in keys}
    rows = len(local["input_ids"]) * jax.process_count()
    if mesh is not None and rows_stay_on_their_process(mesh, rows):
        return put_batch(local, mesh)  # as training batches: each process's devices hold its own rows
    from jax.experimental import multihost_utils
    return same_on_every_process({k: np.asarray(multihost_utils.process_allgather(v, tiled=True))
                                  for k, v in local.items()}, mesh)


def same_on_every_process(arrays: dict[str, np.ndarray], mesh: Mesh | None) -> dict[str, jax.Array]:
    """Host arrays that are the same on every process as global arrays on `mesh`, split over its data axes where
    they divide the rows; without a mesh, or on one process, plain device arrays."""
    if mesh is None or jax.process_count() == 1:
        return {k: jnp.asarray(v) for k, v in arrays.items()}
    out: dict[str, jax.Array] = {}
    for key, value in arrays.items():
        sharding = NamedSharding(mesh, batch_spec(mesh, len(value)))
        out[key] = jax.make_array_from_callback(value.shape, sharding, lambda index, value=value: value[index])
    return out


def heldout_loss(model: Any, batches: Iterable[dict[str, Any]], *, chunk: int = 256) -> dict[str, float]:
    """Mean next-token cross-entropy (nats) over the masked targets of `batches`, and its perplexity."""
    graphdef, state = nnx.split(model)
    mesh = model_mesh(model)
    total, count = 0.0, 0.0
    for batch in batches:
        nll, n = _heldout_sums(graphdef, state, batch_arrays(batch, mesh), chunk)
        total, count = total + float(to_host(nll)), count + float(to_host(n))
    if count == 0:
        raise ValueError("heldout_loss: the batches have no target with a non-zero loss_mask.")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(count)}


# The scoring programs are compiled once per model structure and shapes (the graph is static), not once per call:
# students of one shape and dtype share them.
@functools.partial(jax.jit, static_argnums=(0, 3))
def _heldout_sums(graphdef, state, batch: dict[str, jax.Array], chunk: int) -> tuple[jax.Array, jax.Array]:
    logprobs, weights = token_logprobs(nnx.merge(graphdef, state), batch, chunk)
    return -jnp.sum(jnp.where(weights > 0, logprobs * weights, 0.0)), jnp.sum(weights)


def parameter_count(model: Any) -> int:
    """Number of parameters (nnx.Param leaves) of an NNX model."""
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


# ------------------------------------------------------------------------------------------------ model vs reference
def _online_compare(model, reference, hidden, ref_hidden, vocab_chunk: int,
                    targets: jax.Array | None = None) -> dict[str, jax.Array]:
    """Per row of (R, D) hidden states: KL(reference || model), whether the two top-1 tokens agree and both
    log-normalisers (`lse`, `ref_lse`); with `targets` (R,) also both models' logit of each row's target
    (`target`, `ref_target`), so a log-probability is `target - lse`. One pass over vocabulary blocks (running
    logsumexps, a running sum of p_ref * (l_ref - l_model), running argmaxes), so no (R, V) array exists. The
    last block is clamped to end at V and masks the entries already seen."""
    head, ref_head = model.head_matrix(), reference.head_matrix()
    vocab = head.shape[0]
    if ref_head.shape[0] != vocab:
        raise ValueError(f"the model's vocabulary ({vocab}) differs from the reference's ({ref_head.shape[0]}); "
                         "agreement and KL need the same tokenizer.")
    width = min(vocab_chunk, vocab)
    rows = hidden.shape[0]
    minus_inf = jnp.full((rows,), -jnp.inf, jnp.float32)
    zeros = jnp.zeros((rows,), jnp.float32)
    first = jnp.zeros((rows,), jnp.int32)
    wanted = jnp.full((rows,), -1, jnp.int32) if targets is None else targets.astype(jnp.int32)

    def body(i, carry):
        m_ref, z_ref, cross, m_mod, z_mod, best_ref, arg_ref, best_mod, arg_mod, t_mod, t_ref = carry
        start = jnp.minimum(i * width, vocab - width)
        index = start + jnp.arange(width)
        fresh = index >= i * width
        l_mod = model.logits_from_hidden(hidden, jax.lax.dynamic_slice_in_dim(head, start, width))
        l_ref = reference.logits_from_hidden(ref_hidden, jax.lax.dynamic_slice_in_dim(ref_head, start, width))
        hit = fresh & (index[None, :] == wanted[:, None])
        t_mod = t_mod + jnp.sum(jnp.where(hit, l_mod, 0.0), axis=-1)
        t_ref = t_ref + jnp.sum(jnp.where(hit, l_ref, 0.0), axis=-1)
        l_mod, l_ref = jnp.where(fresh, l_mod, -jnp.inf), jnp.where(fresh, l_ref, -jnp.inf)
        new_ref, new_mod = jnp.maximum(m_ref, l_ref.max(-1)), jnp.maximum(m_mod, l_mod.max(-1))
        p_ref = jnp.exp(l_ref - new_ref[:, None])  # unnormalised, 0 on masked entries
        scale_ref = jnp.exp(m_ref - new_ref)
        z_ref = z_ref * scale_ref + p_ref.sum(-1)
        cross = cross * scale_ref + jnp.sum(jnp.where(fresh, p_ref * (l_ref - l_mod), 0.0), axis=-1)
        z_mod = z_mod * jnp.exp(m_mod - new_mod) + jnp.exp(l_mod - new_mod[:, None]).sum(-1)
        top_ref, top_mod = l_ref.max(-1), l_mod.max(-1)  # ties keep the lowest index, as argmax does
        arg_ref = jnp.where(top_ref > best_ref, start + jnp.argmax(l_ref, -1), arg_ref)
        arg_mod = jnp.where(top_mod > best_mod, start + jnp.argmax(l_mod, -1), arg_mod)
        return (new_ref, z_ref, cross, new_mod, z_mod, jnp.maximum(best_ref, top_ref), arg_ref,
                jnp.maximum(best_mod, top_mod), arg_mod, t_mod, t_ref)

    init = (minus_inf, zeros, zeros, minus_inf, zeros, minus_inf, first, minus_inf, first, zeros, zeros)
    m_ref, z_ref, cross, m_mod, z_mod, _, arg_ref, _, arg_mod, t_mod, t_ref = jax.lax.fori_loop(
        0, -(-vocab // width), body, init)
    lse, ref_lse = m_mod + jnp.log(z_mod), m_ref + jnp.log(z_ref)
    return {"kl": cross / z_ref - ref_lse + lse, "agree": (arg_ref == arg_mod).astype(jnp.float32),
            "lse": lse, "ref_lse": ref_lse, "target": t_mod, "ref_target": t_ref}


def _pick(values: dict, *keys: str) -> tuple:
    return tuple(values[key] for key in keys)


def _compare_batch(model, reference, batch, vocab_chunk: int, row_chunk: int):
    """(sum of KL, sum of agreements, scored tokens) over the scored positions of one batch."""
    _, weights, _ = next_token_targets(batch)
    input_ids = batch["input_ids"]
    hidden = model(input_ids, **forward_inputs(model, batch), return_logits=False).final_hidden
    ref_hidden = reference(input_ids, **forward_inputs(reference, batch), return_logits=False).final_hidden
    flat = [h.reshape(-1, h.shape[-1]) for h in (hidden, ref_hidden)]
    blocks = tuple(row_blocks(h, row_chunk) for h in flat)
    kl, agree = jax.lax.map(lambda hs: _pick(_online_compare(model, reference, hs[0], hs[1], vocab_chunk),
                                             "kl", "agree"), blocks)
    w = weights.reshape(-1)
    kl, agree = kl.reshape(-1)[:w.size], agree.reshape(-1)[:w.size]
    return jnp.sum(jnp.where(w > 0, kl * w, 0.0)), jnp.sum(agree * w), jnp.sum(w)


@functools.partial(jax.jit, static_argnums=(0, 1, 5, 6))
def _compare_sums(graph, ref_graph, state, ref_state, batch: dict[str, jax.Array], vocab_chunk: int,
                  row_chunk: int):
    return _compare_batch(nnx.merge(graph, state), nnx.merge(ref_graph, ref_state), batch, vocab_chunk, row_chunk)


def agreement_and_kl(model: Any, reference: Any, batches: Iterable[dict[str, Any]], *, vocab_chunk: int = 16384,
                     row_chunk: int = 256) -> dict[str, float]:
    """Top-1 agreement of `model` with `reference` (the teacher) and KL(reference || model) at temperature 1,
    per scored token (loss masks, padding and document boundaries respected), averaged over `batches`. Memory
    is bounded by (row_chunk, vocab_chunk) float32 blocks whatever the vocabulary size."""
    graph, state = nnx.split(model)
    ref_graph, ref_state = nnx.split(reference)
    mesh = model_mesh(model)
    kl = agree = count = 0.0
    for batch in batches:
        sums = [float(to_host(x)) for x in _compare_sums(graph, ref_graph, state, ref_state,
                                                         batch_arrays(batch, mesh), vocab_chunk, row_chunk)]
        kl, agree, count = kl + sums[0], agree + sums[1], count + sums[2]
    if count == 0:
        raise ValueError("agreement_and_kl: the batches have no target with a non-zero loss_mask.")
    return {"top1_agreement": agree / count, "kl": kl / count, "tokens": int(count)}


def sequence_loglikelihoods(model: Any, rows: np.ndarray, scored: np.ndarray, *, batch_size: int = 8,
                            chunk: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `rows` (N, L) token ids: the summed log-likelihood of the tokens t with `scored[n, t]` true
    (each predicted from the tokens before it, one document per row, right padding allowed), and their count.
    Rows go through in batches of `batch_size` (the last one padded), so one compilation serves all. The LM head
    runs only on the window of positions that predict scored tokens (a multiple-choice candidate is a few tokens
    after a long context: the head is most of the cost). Multi-host: every process passes the same rows and gets
    every row's result."""
    rows, scored = np.asarray(rows, np.int32), np.asarray(scored, bool)
    if scored[:, 0].any():
        raise ValueError("sequence_loglikelihoods: the first token of a row has no context to be predicted from.")
    loss_mask = np.zeros(scored.shape, np.float32)
    loss_mask[:, :-1] = scored[:, 1:]  # loss_mask[t] weights the prediction of token t + 1
    has = scored.any(axis=1)
    first = np.where(has, scored.argmax(axis=1) - 1, 0).astype(np.int32)  # first position predicting a scored token
    last = np.where(has, scored.shape[1] - 2 - scored[:, ::-1].argmax(axis=1), 0)
    width = int(-(-max(1, int((last - first).max()) + 1) // 8) * 8)
    fill = -len(rows) % batch_size
    rows = np.concatenate([rows, np.zeros((fill, rows.shape[1]), np.int32)])
    loss_mask = np.concatenate([loss_mask, np.zeros((fill, rows.shape[1]), np.float32)])
    first = np.concatenate([first, np.zeros(fill, np.int32)])
    graph, state = nnx.split(model)
    mesh = model_mesh(model)
    totals, counts = [], []
    for i in range(0, len(rows), batch_size):
        batch = same_on_every_process({"input_ids": rows[i:i + batch_size], "loss_mask": loss_mask[i:i + batch_size],
                                       "first": first[i:i + batch_size]}, mesh)
        total, count = _window_sums(graph, state, batch, width, chunk)
        totals.append(to_host(total))
        counts.append(to_host(count))
    n = len(rows) - fill
    return np.concatenate(totals)[:n].astype(np.float64), np.concatenate(counts)[:n].astype(np.int64)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _window_sums(graph, state, batch: dict[str, jax.Array], width: int, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Per row: the summed log-likelihood of the scored tokens in the `width` positions from `batch["first"]`,
    and their count (sequence_loglikelihoods)."""
    net = nnx.merge(graph, state)
    hidden = net(batch["input_ids"], **forward_inputs(net, batch), return_logits=False).final_hidden
    raw = batch["first"][:, None] + jnp.arange(width)[None, :]
    positions = jnp.minimum(raw, hidden.shape[1] - 2)
    inside = (raw <= hidden.shape[1] - 2).astype(jnp.float32)  # past the row's end: clamped, not counted
    h = jnp.take_along_axis(hidden, positions[..., None], axis=1).reshape(-1, hidden.shape[-1])
    targets = jnp.take_along_axis(batch["input_ids"], positions + 1, axis=1).reshape(-1)
    weights = jnp.take_along_axis(batch["loss_mask"], positions, axis=1) * inside
    logprobs = target_logprobs(net, h, targets, chunk).reshape(weights.shape)
    return jnp.sum(jnp.where(weights > 0, logprobs * weights, 0.0), axis=-1), jnp.sum(weights, axis=-1)


__all__ = ["heldout_loss", "token_logprobs", "batch_arrays", "parameter_count", "agreement_and_kl",
           "sequence_loglikelihoods", "model_mesh", "same_on_every_process"]
