"""Hand a model to Tunix (Google's JAX post-training library: DPO, GRPO, its sampler) and take it back.

    policy = to_tunix(student)                 # shares the student's parameters; nothing is copied
    ...  DPOTrainer(policy, ...) / RLCluster(actor=policy, ...) + GRPOLearner(...)
    trained = from_tunix(trainer.model)        # our CausalLM with the trained weights -> save_pretrained

Tunix calls a policy as `model(tokens, positions, cache, attention_mask) -> (logits, cache)`:

- training passes `cache=None` and a (B, T, T) mask (causal over real tokens, or any other structure): it is
  used as given, and sliding-window layers also drop keys a window or more behind the query (by `positions`);
- its sampler makes a cache with `init_cache(batch, cache_size, dtype)`, prefills the left-padded prompts with a
  (B, P, cache_size) mask and decodes one token at a time with a (B, 1, cache_size) mask. Slot j of its buffers is
  token j of its token buffer, so the mask's entry at the slot a new token is written to says whether that token
  is real (not padding). The cache is a dict `{"layer_i": {"k", "v", "end_index", "positions"}}` of arrays whose
  first axis is the batch (so its beam search can repeat and gather them); it holds our KV cache
  (nnx_surgery/surgery/modeling/kv_cache.py) layer by layer: full-attention layers keep `cache_size` slots, sliding layers a ring of
  the window, and `positions` are the tokens' positions in each slot (-1: empty or padding). Causality and the
  windows come from those positions, exactly as in `surgery.generate`.

Tunix's RL cluster reads `model.config.num_layers / num_kv_heads / head_dim` and re-creates the model with
`nnx.merge` when the actor's mesh differs from the model's: read the trained weights back from the trainer's
model (`rl_cluster.actor_trainer.model`), not from the object passed in.

Install: Tunix 0.1.7's wheel pins `safetensors<0.8`, which current transformers cannot use, so it is installed
without its dependencies, next to the small packages it needs (the `tunix` extra): see INSTALL_HINT.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .kv_cache import KVCache
from .causal_lm import CausalLM

INSTALL_HINT = ("pip install 'nnx-surgery[tunix]' && pip install --no-deps google-tunix==0.1.7 "
                "(Tunix's wheel pins safetensors<0.8, which transformers cannot use, so it goes in without its "
                "dependencies; the extra holds the small packages it needs)")


def require_tunix():
    """Import Tunix, or say how to install it."""
    try:
        import tunix  # noqa: F401
        import tunix.generate.sampler  # noqa: F401  (the first module that needs the extra's packages)
    except ImportError as error:
        raise ImportError(f"Tunix is not usable here ({error}); install it with: {INSTALL_HINT}") from error
    return tunix


@dataclasses.dataclass(frozen=True)
class TunixConfig:
    """What Tunix reads from `model.config` (the RL cluster sizes its KV cache from the first three)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    embed_dim: int
    vocab_size: int


class TunixModel(nnx.Module):
    """Our `CausalLM` behind Tunix's calling convention. `model` is the wrapped CausalLM itself (same parameters)."""

    def __init__(self, model: CausalLM):
        cfg = model.config
        self.model = model
        self.config = TunixConfig(num_layers=len(model.layers), num_kv_heads=cfg.num_key_value_heads,
                                  head_dim=cfg.head_dim, num_heads=cfg.num_attention_heads,
                                  embed_dim=cfg.hidden_size, vocab_size=cfg.vocab_size)

    @property
    def num_embed(self) -> int:  # the sampler sizes its logits buffer with it
        return self.config.vocab_size

    @property
    def embed_dim(self) -> int:
        return self.config.embed_dim

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, cache: dict | None = None,
                 attention_mask: jax.Array | None = None, decode_only_last_token: bool = False
                 ) -> tuple[jax.Array, dict | None]:
        """`tokens` (B, T); `positions` (B, T); `attention_mask` (B, T, T) without a cache, (B, T, S) with one
        (S: the cache size). Returns float32 logits (B, T, V) (or (B, 1, V) for the last token only) and the
        updated cache (None without one)."""
        if cache is not None:
            return self._cached(tokens, positions, cache, attention_mask, decode_only_last_token)
        model = self.model
        if attention_mask is None:
            logits = model(tokens, positions=positions).logits
        else:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            masks = _windowed_masks(model, attention_mask.astype(bool), positions)
            x = model.embed(tokens)
            for layer in model.layers:
                x = layer(x, positions, masks[layer.attention_type], None)
            hidden = model.norm(x)
            logits = model.logits_from_hidden(hidden[:, -1:] if decode_only_last_token else hidden)
        if logits is None:
            raise RuntimeError("the model's forward returned no logits.")
        return (logits[:, -1:] if decode_only_last_token else logits), None

    def _cached(self, tokens, positions, cache: dict, attention_mask, last_only: bool):
        if attention_mask is None:
            raise ValueError("TunixModel with a cache needs the (B, T, cache_size) attention_mask Tunix's sampler "
                             "passes: it gives the cache's length and which new tokens are padding.")
        kv = self._kv_cache(cache, attention_mask.shape[-1])
        valid = _new_tokens_real(attention_mask, kv.end, tokens.shape[1])
        out = self.model(tokens, positions=positions, attention_mask=valid, cache=kv, return_logits=False)
        hidden = out.final_hidden[:, -1:] if last_only else out.final_hidden
        if out.cache is None:
            raise RuntimeError("the model's output has no cache although it was given one.")
        return self.model.logits_from_hidden(hidden), self._cache_dict(out.cache)

    def init_cache(self, batch_size: int, cache_size: int, dtype=None) -> dict:
        """An empty cache for `batch_size` rows of up to `cache_size` tokens (prompt padding included), in Tunix's
        per-layer dict form."""
        return self._cache_dict(self.model.init_cache(batch_size, cache_size, dtype))

    def _cache_dict(self, kv: KVCache) -> dict:
        batch = kv.next_position.shape[0]
        end = jnp.broadcast_to(kv.end, (batch,)).astype(jnp.int32)
        return {f"layer_{i}": {"k": kv.keys[i], "v": kv.values[i], "end_index": end,
                               "positions": kv.slot_positions[layer.attention_type]}
                for i, layer in enumerate(self.model.layers)}

    def _kv_cache(self, cache: dict, max_len: int) -> KVCache:
        """Our KVCache over the dict's buffers; `max_len` (static): the cache's length in tokens."""
        entries = [cache[f"layer_{i}"] for i in range(len(self.model.layers))]
        slot_positions: dict[str, jax.Array] = {}
        for layer, entry in zip(self.model.layers, entries):
            slot_positions.setdefault(layer.attention_type, entry["positions"])
        # every buffer holds each row's latest token, so the next real position follows the largest one seen
        latest = jnp.max(jnp.stack([p.max(axis=1) for p in slot_positions.values()]), axis=0)
        return KVCache(keys=tuple(e["k"] for e in entries), values=tuple(e["v"] for e in entries),
                       slot_positions=slot_positions, end=entries[0]["end_index"][0],
                       next_position=(latest + 1).astype(jnp.int32), max_len=max_len, fresh=False)


def _windowed_masks(model: CausalLM, mask: jax.Array, positions: jax.Array) -> dict[str, jax.Array]:
    """The given (B, T, S) mask per attention type; sliding layers also drop keys `window` or more positions behind
    the query (the window counts the query itself, as transformers does)."""
    masks = {}
    for layer in model.layers:
        window = layer.self_attn.window
        if layer.attention_type in masks:
            continue
        if window is None:
            masks[layer.attention_type] = mask
        else:
            behind = positions[:, :, None] - positions[:, None, :]
            masks[layer.attention_type] = mask & (behind < window)
    return masks


def _new_tokens_real(attention_mask: jax.Array, end: jax.Array, length: int) -> jax.Array:
    """(B, T) bool: whether each new token is real, read from the mask at the slot it is written to (`end + t`):
    Tunix's masks let a real token see itself and keep padding out of every row."""
    slots = jnp.minimum(end + jnp.arange(length), attention_mask.shape[-1] - 1)
    index = jnp.broadcast_to(slots[None, :, None], (attention_mask.shape[0], length, 1))
    return jnp.take_along_axis(attention_mask.astype(bool), index, axis=2)[..., 0]


def to_tunix(model: CausalLM) -> TunixModel:
    """`model` as a Tunix policy (or reference) model. The adapter shares `model`'s parameters: training it trains
    `model` (unless Tunix re-creates it; see `from_tunix`). For a frozen reference, convert a copy:
    `to_tunix(nnx.clone(model))`."""
    require_tunix()
    if not isinstance(model, CausalLM):
        raise TypeError(f"to_tunix takes a surgery CausalLM (load_pretrained, create_model, apply_plan), "
                        f"got {type(model).__name__}.")
    return TunixModel(model)


def from_tunix(model: Any) -> CausalLM:
    """Our `CausalLM` inside a Tunix model made by `to_tunix`, with whatever weights it now holds. Pass the
    trainer's model (`trainer.model`, `rl_cluster.actor_trainer.model`): Tunix may have re-created it."""
    if isinstance(model, TunixModel):
        return model.model
    inner = getattr(model, "model", None)
    if isinstance(inner, TunixModel):  # a trainer (PeftTrainer, DPOTrainer) holding the adapter
        return inner.model
    raise TypeError(f"from_tunix takes the model to_tunix made (or a Tunix trainer holding it), got "
                    f"{type(model).__name__}; for GRPO pass rl_cluster.actor_trainer.model.")


def tunix_sampler(model: TunixModel, tokenizer, cache_size: int):
    """Tunix's own `Sampler` over `model` (a `to_tunix` adapter) with a KV cache of `cache_size` tokens per row
    (padded prompt plus generated tokens). `tokenizer`: a transformers tokenizer (or anything Tunix's
    TokenizerAdapter takes)."""
    require_tunix()
    from tunix.generate import sampler as sampler_lib

    cfg = model.config
    return sampler_lib.Sampler(model, tokenizer, sampler_lib.CacheConfig(
        cache_size=cache_size, num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))


__all__ = ["TunixModel", "TunixConfig", "to_tunix", "from_tunix", "tunix_sampler", "require_tunix", "INSTALL_HINT"]
