"""Gemma 1 / 2 / 3 (text) in Flax NNX, shaped like the Hugging Face checkpoint.

One module per HF tensor group, with the same names: a projection's NNX path is its HF tensor name without the
`model.` prefix (`model.layers.3.self_attn.q_proj.weight` is `model.layers[3].self_attn.q_proj.weight` here, NNX
path `layers.3.self_attn.q_proj.weight`); norms hold HF's `.weight` as `.scale`, and `embed_tokens` / `lm_head`
are bare parameters. Every projection holds HF's own `[out, in]` weight, only reshaped to name its head axes
(q_proj `(N, H, D)` is HF's `(N*H, D)`, k/v_proj `(K, H, D)`, o_proj `(D, N, H)` is HF's `(D, N*H)`, gate/up
`(F, D)`, down `(D, F)`, untied lm_head `(V, D)`), so loading and saving are straight byte copies, never
transposes. Each einsum names its axes:

    D hidden   F MLP width   N query heads   K KV heads   G query heads per KV head   H head_dim
    B batch    T query positions   S key positions   V vocabulary

Dimension names in the parameter metadata (`axes`) map to mesh axes: "fsdp" shards the hidden side, "tp" shards
heads, MLP width and vocabulary. Axes that do not divide a dimension evenly are left unsharded.

`Gemma.__call__` returns a `GemmaOutput`. Intermediates (residual stream per layer, attention probabilities,
per-head attention outputs, MLP activations) are computed only when requested with `capture=`, so the default
forward stores nothing extra; they are plain outputs, so they work inside `jax.jit`, `grad` and `vmap`.

Masks come from positions, once per attention type: causal, in the sliding window, not padding, and with
`segment_ids` (packed documents) in the query's own document. With `cache=` (`init_cache`, surgery/generate.py)
keys include the cached ones and the output carries the updated cache: prefill a prompt batch, then decode.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .config import FULL, SLIDING, GemmaConfig
from .generate import KVCache

CAPTURABLE = frozenset({"residual", "attention_probs", "head_outputs", "mlp_activations", "normed_inputs"})


# ------------------------------------------------------------------------------------------------ sharding helpers
def fitted_spec(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh=None) -> tuple[str | None, ...]:
    """Mesh axis names for a tensor, dropping axes the mesh lacks or that do not divide the dimension."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes)) if mesh is not None and not mesh.empty else {}
    return tuple(a if a in sizes and dim % sizes[a] == 0 else None for dim, a in zip(shape, axes))


_ABSTRACT = contextvars.ContextVar("surgery_abstract_parameters", default=False)


def _param(init, rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str | None, ...], dtype) -> nnx.Param:
    """A parameter carrying its logical `axes`; sharded at creation when a mesh is active (Flax eager sharding).

    Inside `abstract_model` the value is a `jax.ShapeDtypeStruct` made directly (no initialiser is traced, no
    random key is drawn), with the sharding the concrete parameter would get."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = fitted_spec(shape, axes, mesh) if mesh is not None and not mesh.empty else None
    if _ABSTRACT.get():
        sharding = None if spec is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        variable = nnx.Param(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding), axes=axes)
        if spec is not None:
            variable.set_metadata("out_sharding", spec)  # as eager sharding records it, without placing anything
        return variable
    value = init(None if rngs is None else rngs.params(), shape, dtype)
    if spec is not None:
        return nnx.Param(value, axes=axes, out_sharding=spec)
    return nnx.Param(value, axes=axes)


def _normal(std: float, drawn_as: tuple[int, ...] | None = None):
    """normal(std) values; with `drawn_as`, drawn in the axis order `drawn_as` of the parameter's shape and then
    moved into place (projections draw in (in, out) order, so `create_model(config, seed=s)` gives the same
    weights as before projections were stored in HF's [out, in] layout)."""
    if drawn_as is None:
        return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

    def init(key, shape, dtype):
        drawn = std * jax.random.normal(key, tuple(shape[a] for a in drawn_as), jnp.float32)
        return jnp.transpose(drawn, tuple(int(a) for a in np.argsort(drawn_as))).astype(dtype)
    return init


def _zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


# ------------------------------------------------------------------------------------------------ modules
class RMSNorm(nnx.Module):
    """Gemma RMSNorm: `x * rsqrt(mean(x²) + eps) * (1 + w)` in float32, cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.scale = _param(_zeros, None, (dim,), (None,), dtype)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


# Axis orders in which projections draw their initial values: (in, out), as Flax kernels were stored.
IN_OUT = (1, 0)  # [out, in] matrices: gate/up (F, D), down (D, F), lm_head (V, D)
IN_OUT_HEADS = (2, 0, 1)  # q/k/v (N, H, D) drawn as (D, N, H)
IN_HEADS_OUT = (1, 2, 0)  # o_proj (D, N, H) drawn as (N, H, D)


class Projection(nnx.Module):
    """A bias-free projection whose `weight` is HF's `[out, in]` matrix with named axes; `spec` names the einsum
    applied to the input (`"BTD,NHD->BTNH"`: input first, weight second, its input axes last). It runs as one 2-D
    matmul over flattened head axes: XLA on CPU transposes a 3-D weight on every call (slower than the matmul)."""

    def __init__(self, shape: tuple[int, ...], axes: tuple[str | None, ...], spec: str, *, drawn_as: tuple[int, ...],
                 dtype, rngs: nnx.Rngs):
        self.weight = _param(_normal(0.02, drawn_as), rngs, shape, axes, dtype)
        self.spec = spec
        inputs, weight = spec.split("->")[0].split(",")
        self.num_in_axes = sum(axis in inputs for axis in weight)

    def __call__(self, x: jax.Array) -> jax.Array:
        weight, k = self.weight[...].astype(x.dtype), self.num_in_axes
        out_shape, lead = weight.shape[:-k], x.shape[:x.ndim - k]
        matrix = weight.reshape(math.prod(out_shape), -1)
        return jnp.einsum("...I,OI->...O", x.reshape(*lead, -1), matrix).reshape(*lead, *out_shape)


class Attention(nnx.Module):
    def __init__(self, cfg: GemmaConfig, attention_type: str, *, dtype, rngs: nnx.Rngs):
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Projection((n, h, d), ("tp", None, "fsdp"), "BTD,NHD->BTNH",
                                 drawn_as=IN_OUT_HEADS, dtype=dtype, rngs=rngs)
        self.k_proj = Projection((k, h, d), ("tp", None, "fsdp"), "BSD,KHD->BSKH",
                                 drawn_as=IN_OUT_HEADS, dtype=dtype, rngs=rngs)
        self.v_proj = Projection((k, h, d), ("tp", None, "fsdp"), "BSD,KHD->BSKH",
                                 drawn_as=IN_OUT_HEADS, dtype=dtype, rngs=rngs)
        self.o_proj = Projection((d, n, h), ("fsdp", "tp", None), "BTNH,DNH->BTD",
                                 drawn_as=IN_HEADS_OUT, dtype=dtype, rngs=rngs)
        if cfg.uses_qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.attention_type = attention_type
        self.rope = cfg.rope[attention_type]
        self.window = cfg.sliding_window if attention_type == SLIDING else None
        self.scale = cfg.attention_scale
        self.softcap = cfg.attention_softcap
        self.num_kv_heads, self.head_dim = k, h

    def __call__(self, x, positions, mask, captured: dict | None, kv=None):
        """`mask` (B, T, S) says which keys each query sees (None: causal and windowed by `positions`); `kv`, with a
        KV cache, takes the new keys and values and returns those to attend to (cached and new, S of them)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        if kv is not None:
            k, v = (a.astype(x.dtype) for a in kv(k, v))
        batch, length, num_heads, _ = q.shape
        groups = num_heads // self.num_kv_heads
        q = q.reshape(batch, length, self.num_kv_heads, groups, self.head_dim)  # head n = kv * groups + g
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k).astype(jnp.float32) * self.scale
        if self.softcap:
            scores = jnp.tanh(scores / self.softcap) * self.softcap
        allowed = mask if mask is not None else attention_mask(positions, positions, self.window)  # (B, T, S)
        scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        heads = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(batch, length, num_heads, self.head_dim)
        if captured is not None:
            if "attention_probs" in captured:
                captured["attention_probs"].append(probs.reshape(batch, num_heads, length, -1))
            if "head_outputs" in captured:
                captured["head_outputs"].append(heads)
        return self.o_proj(heads)


class MLP(nnx.Module):
    """GeGLU: `down(gelu_tanh(gate(x)) * up(x))`."""

    def __init__(self, cfg: GemmaConfig, *, dtype, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Projection((f, d), ("tp", "fsdp"), "BTD,FD->BTF", drawn_as=IN_OUT, dtype=dtype, rngs=rngs)
        self.up_proj = Projection((f, d), ("tp", "fsdp"), "BTD,FD->BTF", drawn_as=IN_OUT, dtype=dtype, rngs=rngs)
        self.down_proj = Projection((d, f), ("fsdp", "tp"), "BTF,DF->BTD", drawn_as=IN_OUT, dtype=dtype, rngs=rngs)

    def __call__(self, x, captured: dict | None):
        activations = jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x)
        if captured is not None and "mlp_activations" in captured:
            captured["mlp_activations"].append(activations)
        return self.down_proj(activations)


class DecoderLayer(nnx.Module):
    """One block. Gemma 1: `post_attention_layernorm` is the pre-MLP norm. Gemma 2/3: it normalises the attention
    output, and `pre_/post_feedforward_layernorm` wrap the MLP (same tensor name, different meaning)."""

    def __init__(self, cfg: GemmaConfig, attention_type: str, *, dtype, rngs: nnx.Rngs):
        eps, d = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
        self.self_attn = Attention(cfg, attention_type, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
        if cfg.uses_sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
            self.post_feedforward_layernorm = RMSNorm(d, eps, dtype=dtype, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        self.sandwich = cfg.uses_sandwich_norms

    @property
    def attention_type(self) -> str:
        return self.self_attn.attention_type

    def __call__(self, x, positions, mask, captured: dict | None, kv=None):
        normed = self.input_layernorm(x)
        if captured is not None and "normed_inputs" in captured:
            captured["normed_inputs"].append(normed)
        attn = self.self_attn(normed, positions, mask, captured, kv)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), captured))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), captured)


@dataclasses.dataclass
class GemmaOutput:
    """What a forward pass returns. Tuples are per layer; `residual` has L + 1 entries (embeddings first)."""

    logits: jax.Array | None
    final_hidden: jax.Array  # after the final norm, the input of the (tied) LM head
    residual: tuple[jax.Array, ...] | None = None
    attention_probs: tuple[jax.Array, ...] | None = None  # (B, N, T, S), in the activation dtype
    head_outputs: tuple[jax.Array, ...] | None = None  # (B, T, N, H), attention output before o_proj
    mlp_activations: tuple[jax.Array, ...] | None = None  # (B, T, F), input of down_proj
    normed_inputs: tuple[jax.Array, ...] | None = None  # (B, T, D), input_layernorm outputs
    cache: KVCache | None = None  # the updated KV cache, when one was passed


jax.tree_util.register_dataclass(
    GemmaOutput, data_fields=[f.name for f in dataclasses.fields(GemmaOutput)], meta_fields=[])


class Gemma(nnx.Module):
    """A Gemma causal LM. `config` decides the family, sizes and every layer's attention type."""

    def __init__(self, config: GemmaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        if rngs is None and not _ABSTRACT.get():  # abstract parameters draw no keys (nnx.Rngs costs a compile)
            rngs = nnx.Rngs(0)
        self.config = config
        d, v = config.hidden_size, config.vocab_size
        self.embed_tokens = _param(_normal(0.02), rngs, (v, d), ("tp", "fsdp"), dtype)
        self.layers = nnx.List([DecoderLayer(config, t, dtype=dtype, rngs=rngs) for t in config.layer_types])
        self.norm = RMSNorm(d, config.rms_norm_eps, dtype=dtype, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = _param(_normal(0.02, IN_OUT), rngs, (v, d), ("tp", "fsdp"), dtype)

    @property
    def dtype(self):
        return self.embed_tokens[...].dtype

    def embed(self, input_ids: jax.Array) -> jax.Array:
        table = self.embed_tokens[...]
        # The scale is cast to the weight dtype first, as in transformers (bf16 rounds sqrt(3072) to 55.5).
        return table[input_ids] * jnp.asarray(math.sqrt(self.config.hidden_size), table.dtype)

    def head_matrix(self) -> jax.Array:
        """The (V, D) matrix of the LM head: `logits = final_hidden @ head_matrix().T`."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens[...]
        return self.lm_head[...]

    def logits_from_hidden(self, final_hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """Final-norm hidden states -> logits (float32), with the final soft-cap. `head` may be a row block of
        `head_matrix()` (vocab chunking)."""
        head = self.head_matrix() if head is None else head
        logits = jnp.einsum("...D,VD->...V", final_hidden, head.astype(final_hidden.dtype),
                            preferred_element_type=jnp.float32)
        return softcap(logits, self.config.final_logit_softcapping)

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 capture: Iterable[str] = (), return_logits: bool = True, inputs_embeds: jax.Array | None = None,
                 cache: KVCache | None = None) -> GemmaOutput:
        """`input_ids` (B, T) int. `attention_mask` (B, T) marks real tokens (1) vs padding (0), as in transformers.
        `segment_ids` (B, T) int marks packed documents (0: padding): a token sees only earlier tokens of its own
        document; `positions` then count from 0 in each document (derived from `segment_ids` when not given).
        `capture` names intermediates to return (see CAPTURABLE). `inputs_embeds` (B, T, D), when given, replaces
        `self.embed(input_ids)` (already scaled by sqrt(D)): a training step can then differentiate the embedding
        lookup itself, e.g. to add its gradient straight into the tied LM head's. `cache` (`init_cache`): the tokens
        continue the cached ones (positions too, unless given); the output's `cache` holds them as well."""
        capture = frozenset(capture)
        if not capture <= CAPTURABLE:
            raise ValueError(f"capture={sorted(capture - CAPTURABLE)} unknown; choose from {sorted(CAPTURABLE)}.")
        captured = {name: [] for name in capture} if capture else None
        positions, masks, step = self._masks(input_ids.shape, positions, attention_mask, segment_ids, cache)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = [x] if "residual" in capture else None
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, masks[layer.attention_type], captured, None if step is None else step.layer(i))
            if residual is not None:
                residual.append(x)
        final_hidden = self.norm(x)
        logits = self.logits_from_hidden(final_hidden) if return_logits else None
        extras = {name: tuple(values) for name, values in (captured or {}).items() if name != "residual"}
        return GemmaOutput(logits=logits, final_hidden=final_hidden,
                           residual=tuple(residual) if residual is not None else None,
                           cache=None if step is None else step.finish(), **extras)

    def _masks(self, shape, positions, padding, segment_ids, cache):
        """Positions (B, T), one (B, T, S) attention mask per attention type, and the cache step (or None)."""
        windows = {layer.attention_type: layer.self_attn.window for layer in self.layers}
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("segment_ids cannot be combined with cache=; decode one document per row.")
            step = cache.begin(shape[1], padding, positions)
            return step.positions, {kind: attention_mask(step.positions, keys, windows[kind], keys >= 0)
                                    for kind, keys in step.key_positions.items()}, step
        if positions is None:
            positions = (segment_positions(segment_ids) if segment_ids is not None else
                         jnp.broadcast_to(jnp.arange(shape[1]), shape))
        key_mask = None if padding is None else padding.astype(bool)
        return positions, {kind: attention_mask(positions, positions, window, key_mask, segment_ids, segment_ids)
                           for kind, window in windows.items()}, None

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache for `batch` rows of up to `max_len` tokens (prompt, padding and generated) in `dtype`
        (default: the model's). Full-attention layers get `max_len` slots, sliding layers a ring of the window."""
        attention = [layer.self_attn for layer in self.layers]
        layers = [(a.window, a.attention_type, a.num_kv_heads, a.head_dim) for a in attention]
        return KVCache.create(layers, batch, max_len, self.dtype if dtype is None else dtype)


# ------------------------------------------------------------------------------------------------ functions
def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if not cap else jnp.tanh(x / cap) * cap


def apply_rope(x: jax.Array, positions: jax.Array, rope) -> jax.Array:
    """Rotate-half RoPE on (B, T, heads, H); cos/sin made in float32, then cast to the activation dtype."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    inv_freq = inv_freq / rope.linear_factor
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (B, T, H/2)
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    first, second = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-second, first], axis=-1) * sin


def attention_mask(query_positions: jax.Array, key_positions: jax.Array, window: int | None,
                   key_mask: jax.Array | None = None, query_segments: jax.Array | None = None,
                   key_segments: jax.Array | None = None) -> jax.Array:
    """(B, T, S) bool: causal, within the sliding window (which counts the token itself), not padding, and with
    segment ids in the query's own non-zero segment."""
    query, key = query_positions[:, :, None], key_positions[:, None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    if key_mask is not None:
        allowed &= key_mask[:, None, :]
    if query_segments is not None:
        keys = key_segments[:, None, :]
        allowed &= (query_segments[:, :, None] == keys) & (keys != 0)
    return allowed


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions counted from 0 at the start of each segment (a run of equal ids) of every row."""
    index = jnp.arange(segment_ids.shape[1])
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def create_model(config: GemmaConfig, *, dtype=jnp.float32, seed: int = 0, mesh=None) -> Gemma:
    """A randomly initialised Gemma (normal(0.02) weights, zero norms), sharded over `mesh` when given."""
    if mesh is None:
        return Gemma(config, dtype=dtype, rngs=nnx.Rngs(seed))
    with jax.set_mesh(mesh):
        return Gemma(config, dtype=dtype, rngs=nnx.Rngs(seed))


def abstract_model(config: GemmaConfig, *, dtype=jnp.float32, mesh=None) -> Gemma:
    """The model's structure with ShapeDtypeStruct leaves (sharded like `create_model`'s under `mesh`): no memory
    is allocated and no initialiser runs, so it costs milliseconds even for a 7B config."""
    token = _ABSTRACT.set(True)
    try:
        if mesh is None:
            return Gemma(config, dtype=dtype)
        with jax.set_mesh(mesh):
            return Gemma(config, dtype=dtype)
    finally:
        _ABSTRACT.reset(token)


def parameter_sharding(variable: nnx.Variable, mesh) -> jax.sharding.Sharding:
    """Where one parameter lives: NamedSharding from its logical axes on `mesh`, else the default device."""
    if mesh is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    axes = variable.get_metadata().get("axes") or (None,) * len(variable.shape)
    spec = fitted_spec(tuple(variable.shape), tuple(axes), mesh)
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def layer_types_of(model: Gemma) -> tuple[str, ...]:
    return tuple(layer.attention_type for layer in model.layers)


__all__ = ["Gemma", "GemmaOutput", "KVCache", "create_model", "abstract_model", "apply_rope", "attention_mask",
           "segment_positions", "softcap", "fitted_spec", "parameter_sharding", "CAPTURABLE", "FULL", "SLIDING"]
