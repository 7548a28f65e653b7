"""Held-out language-model loss and perplexity of any model that follows the distill interface.

Batches are the data pipeline's dicts: `loss_mask[b, t]` weights the prediction of token t+1 at position t. The
loss is computed from final hidden states in row chunks through `model.logits_from_hidden`, so full (B, T, V)
float32 logits never exist for large vocabularies.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import jax
import jax.numpy as jnp
from flax import nnx


def _masked_nll(model, input_ids, loss_mask, attention_mask, chunk: int):
    out = model(input_ids, attention_mask=attention_mask, return_logits=False)
    hidden = out.final_hidden[:, :-1].reshape(-1, out.final_hidden.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    weights = loss_mask[:, :-1].reshape(-1).astype(jnp.float32)
    pad = -hidden.shape[0] % chunk
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    targets, weights = jnp.pad(targets, (0, pad)), jnp.pad(weights, (0, pad))
    head = model.head_matrix()

    def body(total, block):
        h, y, w = block
        logits = model.logits_from_hidden(h, head)
        nll = jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        return total + jnp.sum(nll * w), None

    blocks = (hidden.reshape(-1, chunk, hidden.shape[-1]), targets.reshape(-1, chunk), weights.reshape(-1, chunk))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), blocks)
    return total, jnp.sum(weights)


def heldout_loss(model: Any, batches: Iterable[dict[str, Any]], *, chunk: int = 256) -> dict[str, float]:
    """Mean next-token cross-entropy (nats) over the masked targets of `batches`, and its perplexity."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, input_ids, loss_mask, attention_mask):
        return _masked_nll(nnx.merge(graphdef, state), input_ids, loss_mask, attention_mask, chunk)

    total, count = 0.0, 0.0
    for batch in batches:
        mask = batch.get("attention_mask")
        nll, n = score(state, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["loss_mask"]),
                       None if mask is None else jnp.asarray(mask))
        total, count = total + float(nll), count + float(n)
    if count == 0:
        raise ValueError("heldout_loss: the batches have no target with a non-zero loss_mask.")
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(count)}


__all__ = ["heldout_loss"]
