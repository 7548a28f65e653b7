"""Causal LMs of every family the toolkit knows (Gemma 1/2/3, Llama/Mistral/Qwen2) in Flax NNX, shaped like the
Hugging Face checkpoint.

One module per HF tensor group, with the same names, and every parameter made from its declaration in the
family's tensor schema (nnx_surgery/surgery/families/schema.py, nnx_surgery/surgery/families/): a projection's NNX path is its HF tensor name
without the `model.` prefix (`model.layers.3.self_attn.q_proj.weight` is `layers.3.self_attn.q_proj.weight`
here); norms hold HF's `.weight` as `.scale`, and `embed_tokens` / `lm_head` are bare parameters. Every
projection holds HF's own `[out, in]` weight, only reshaped to name its head axes (q_proj `(N, H, D)` is HF's
`(N*H, D)`, o_proj `(D, N, H)` is HF's `(D, N*H)`), so loading and saving are straight byte copies, never
transposes. Each einsum names its axes:

    D hidden   F MLP width   N query heads   K KV heads   G query heads per KV head   H head_dim
    B batch    T query positions   S key positions   V vocabulary

Parameters carry logical axis names (`axes`); sharding.py's rules table maps them to mesh axes.

`CausalLM.__call__` returns a `ModelOutput`. Intermediates (see CAPTURABLE) are computed only when requested
with `capture=`, so the default forward stores nothing extra; they are plain outputs, so they work inside
`jax.jit`, `grad` and `vmap`. `skip_layers` replaces layers by the identity (for layer-removal scores).

Masks come from positions, once per attention type: causal, in the sliding window, not padding, and with
`segment_ids` (packed documents) in the query's own document. With `cache=` (`init_cache`, nnx_surgery/surgery/modeling/generation.py)
keys include the cached ones and the output carries the updated cache: prefill a prompt batch, then decode.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
from typing import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from .model_config import FULL, SLIDING, ModelConfig
from .cpu_matmul import projection_product
from .activations import batch_sharded
from .kv_cache import KVCache
from .layer_remat import check_remat, checkpointed_layer
from .splash import KERNELS, SegmentMask, applies, splash_attention, splash_available
from .positions import apply_rope, attention_mask, rope_frequencies, segment_positions, softcap
from nnx_surgery.surgery.families.schema import declared_tensor, nnx_shape
from .sharding import fitted_spec, mesh_axes, model_shardings, parameter_sharding

# residual: the stream before the first and after every layer; mid_residual: between attention and MLP;
# attention_outputs / mlp_outputs: what each block adds (before Gemma 2/3's post-norms); head_outputs: per head,
# before o_proj; mlp_activations: the input of down_proj; normed_inputs: input_layernorm's output; mlp_inputs: the
# normed input of the MLP (gate_proj and up_proj read it).
CAPTURABLE = frozenset({"residual", "mid_residual", "attention_outputs", "mlp_outputs", "attention_probs",
                        "head_outputs", "mlp_activations", "normed_inputs", "mlp_inputs"})


# ------------------------------------------------------------------------------------------------ parameters
_ABSTRACT = contextvars.ContextVar("surgery_abstract_parameters", default=False)


def _param(init, rngs: nnx.Rngs | None, shape: tuple[int, ...], axes: tuple[str, ...], dtype,
           sharded: bool = True) -> nnx.Param:
    """A parameter carrying its logical `axes` and the `mesh_axes` the rules table maps them to; sharded at
    creation when a mesh is active (Flax eager sharding). Inside `abstract_model` the value is a
    `jax.ShapeDtypeStruct` made directly (no initialiser is traced, no random key is drawn), with the sharding the
    concrete parameter would get."""
    names = mesh_axes(axes) if sharded else (None,) * len(shape)
    mesh = jax.sharding.get_abstract_mesh()
    spec = fitted_spec(shape, names, mesh) if mesh is not None and not mesh.empty else None
    if _ABSTRACT.get():
        sharding = None if spec is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        variable = nnx.Param(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding), axes=axes,
                             mesh_axes=names)
        if spec is not None:
            variable.set_metadata("out_sharding", spec)  # as eager sharding records it, without placing anything
        return variable
    value = init(None if rngs is None else rngs.params(), shape, dtype)
    if spec is not None:
        return nnx.Param(value, out_sharding=spec, axes=axes, mesh_axes=names)
    return nnx.Param(value, axes=axes, mesh_axes=names)


def _declared(cfg: ModelConfig, name: str, init, rngs, dtype) -> nnx.Param:
    """The parameter the family's schema declares under `name` (shape and axes from the declaration)."""
    decl = declared_tensor(cfg, name)
    return _param(init, rngs, nnx_shape(cfg, decl), decl.axes, dtype, sharded=not decl.norm)


def _normal(key, shape, dtype):
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def _ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


# ------------------------------------------------------------------------------------------------ modules
class RMSNorm(nnx.Module):
    """RMSNorm in float32. Gemma (`offset`): `x * rsqrt(mean(x²) + eps) * (1 + w)`, cast back to the input dtype.
    Llama: the normalised `x` is cast back first, then multiplied by `w` (as transformers does each)."""

    def __init__(self, cfg: ModelConfig, name: str, *, dtype, rngs: nnx.Rngs | None):
        self.offset = cfg.norm_offset
        self.scale = _declared(cfg, name, _zeros if self.offset else _ones, None, dtype)
        self.eps = cfg.rms_norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


class Projection(nnx.Module):
    """A projection whose `weight` is HF's `[out, in]` matrix with named axes (and an optional `bias` over the
    output axes); `equation` names the einsum applied to the input (`"BTD,NHD->BTNH"`: input first, weight
    second, its input axes last). It runs as one 2-D matmul over flattened head axes: XLA on CPU transposes a
    3-D weight on every call, which costs more than the matmul."""

    def __init__(self, cfg: ModelConfig, name: str, equation: str, *, bias: bool = False, dtype, rngs: nnx.Rngs | None):
        self.weight = _declared(cfg, f"{name}.weight", _normal, rngs, dtype)
        if bias:
            self.bias = _declared(cfg, f"{name}.bias", _zeros, None, dtype)
        self.equation = equation
        inputs, weight = equation.split("->")[0].split(",")
        self.num_in_axes = sum(axis in inputs for axis in weight)

    def __call__(self, x: jax.Array) -> jax.Array:
        weight, k = self.weight[...].astype(x.dtype), self.num_in_axes
        out_shape, lead = weight.shape[:-k], x.shape[:x.ndim - k]
        matrix = weight.reshape(math.prod(out_shape), -1)
        out = projection_product(x.reshape(*lead, -1), matrix).reshape(*lead, *out_shape)
        return out + self.bias[...].astype(x.dtype) if hasattr(self, "bias") else out


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, attention_type: str, *, dtype, rngs: nnx.Rngs | None):
        common = dict(dtype=dtype, rngs=rngs)
        self.q_proj = Projection(cfg, "self_attn.q_proj", "BTD,NHD->BTNH", bias=cfg.attention_bias, **common)
        self.k_proj = Projection(cfg, "self_attn.k_proj", "BSD,KHD->BSKH", bias=cfg.attention_bias, **common)
        self.v_proj = Projection(cfg, "self_attn.v_proj", "BSD,KHD->BSKH", bias=cfg.attention_bias, **common)
        self.o_proj = Projection(cfg, "self_attn.o_proj", "BTNH,DNH->BTD", bias=cfg.output_bias, **common)
        if cfg.uses_qk_norm:
            self.q_norm = RMSNorm(cfg, "self_attn.q_norm.scale", **common)
            self.k_norm = RMSNorm(cfg, "self_attn.k_norm.scale", **common)
        self.attention_type = attention_type
        self.rope = cfg.rope[attention_type]
        self.window = cfg.sliding_window if attention_type == SLIDING else None
        self.scale = cfg.attention_scale
        self.softcap = cfg.attention_softcap
        self.num_kv_heads, self.head_dim = cfg.num_key_value_heads, cfg.head_dim

    def __call__(self, x, positions, mask, captured: dict | None, kv=None):
        """`mask` (B, T, S) says which keys each query sees (None: causal and windowed by `positions`); `kv`, with a
        KV cache, takes the new keys and values and returns those to attend to (cached and new, S of them)."""
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, positions, self.rope), apply_rope(k, positions, self.rope)
        if kv is not None:
            k, v = (a.astype(x.dtype) for a in kv(k, v))
        if isinstance(mask, SegmentMask):  # the splash kernel (splash.py): no (B, heads, T, S) scores in memory
            heads = splash_attention(q, k, v, mask, scale=self.scale, softcap=self.softcap,
                                     interpret=mask.interpret)
            _keep(captured, "head_outputs", heads)
            return self.o_proj(heads)
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
        if captured is not None and "attention_probs" in captured:
            captured["attention_probs"].append(probs.reshape(batch, num_heads, length, -1))
        _keep(captured, "head_outputs", heads)
        return self.o_proj(heads)


class MLP(nnx.Module):
    """Gated: `down(act(gate(x)) * up(x))`, act the tanh GELU (GeGLU, Gemma) or SiLU (SwiGLU, Llama)."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        self.gate_proj = Projection(cfg, "mlp.gate_proj", "BTD,FD->BTF", dtype=dtype, rngs=rngs)
        self.up_proj = Projection(cfg, "mlp.up_proj", "BTD,FD->BTF", dtype=dtype, rngs=rngs)
        self.down_proj = Projection(cfg, "mlp.down_proj", "BTF,DF->BTD", dtype=dtype, rngs=rngs)
        self.silu = cfg.hidden_act == "silu"

    def __call__(self, x, captured: dict | None):
        gate = self.gate_proj(x)
        activations = (jax.nn.silu(gate) if self.silu else jax.nn.gelu(gate, approximate=True)) * self.up_proj(x)
        _keep(captured, "mlp_activations", activations)
        return self.down_proj(activations)


def _keep(captured: dict | None, name: str, value: jax.Array) -> None:
    if captured is not None and name in captured:
        captured[name].append(value)


def _kept(captured: dict | None, name: str, value: jax.Array) -> jax.Array:
    _keep(captured, name, value)
    return value


class DecoderLayer(nnx.Module):
    """One block. Gemma 1 and Llama: `post_attention_layernorm` is the pre-MLP norm. Gemma 2/3: it normalises the
    attention output, and `pre_/post_feedforward_layernorm` wrap the MLP (same tensor name, different meaning)."""

    def __init__(self, cfg: ModelConfig, attention_type: str, *, dtype, rngs: nnx.Rngs | None):
        self.input_layernorm = RMSNorm(cfg, "input_layernorm.scale", dtype=dtype, rngs=rngs)
        self.self_attn = Attention(cfg, attention_type, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg, "post_attention_layernorm.scale", dtype=dtype, rngs=rngs)
        if cfg.uses_sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(cfg, "pre_feedforward_layernorm.scale", dtype=dtype, rngs=rngs)
            self.post_feedforward_layernorm = RMSNorm(cfg, "post_feedforward_layernorm.scale", dtype=dtype,
                                                      rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)
        self.sandwich = cfg.uses_sandwich_norms

    @property
    def attention_type(self) -> str:
        return self.self_attn.attention_type

    def __call__(self, x, positions, mask, captured: dict | None, kv=None):
        normed = self.input_layernorm(x)
        _keep(captured, "normed_inputs", normed)
        attn = self.self_attn(normed, positions, mask, captured, kv)
        _keep(captured, "attention_outputs", attn)
        if self.sandwich:
            x = x + self.post_attention_layernorm(attn)
            mlp_out = self.mlp(_kept(captured, "mlp_inputs", self.pre_feedforward_layernorm(x)), captured)
            _keep(captured, "mid_residual", x)
            _keep(captured, "mlp_outputs", mlp_out)
            return x + self.post_feedforward_layernorm(mlp_out)
        x = x + attn
        mlp_out = self.mlp(_kept(captured, "mlp_inputs", self.post_attention_layernorm(x)), captured)
        _keep(captured, "mid_residual", x)
        _keep(captured, "mlp_outputs", mlp_out)
        return x + mlp_out


@dataclasses.dataclass
class ModelOutput:
    """What a forward pass returns. Tuples are per layer; `residual` has L + 1 entries (embeddings first)."""

    logits: jax.Array | None
    final_hidden: jax.Array  # after the final norm, the input of the (tied) LM head
    residual: tuple[jax.Array, ...] | None = None
    attention_probs: tuple[jax.Array, ...] | None = None  # (B, N, T, S), in the activation dtype
    head_outputs: tuple[jax.Array, ...] | None = None  # (B, T, N, H), attention output before o_proj
    mlp_activations: tuple[jax.Array, ...] | None = None  # (B, T, F), input of down_proj
    mlp_inputs: tuple[jax.Array, ...] | None = None  # (B, T, D), the normed input of gate_proj and up_proj
    normed_inputs: tuple[jax.Array, ...] | None = None  # (B, T, D), input_layernorm outputs
    mid_residual: tuple[jax.Array, ...] | None = None  # (B, T, D), the stream between attention and MLP
    attention_outputs: tuple[jax.Array, ...] | None = None  # (B, T, D), o_proj's output
    mlp_outputs: tuple[jax.Array, ...] | None = None  # (B, T, D), down_proj's output
    cache: KVCache | None = None  # the updated KV cache, when one was passed


jax.tree_util.register_dataclass(
    ModelOutput, data_fields=[f.name for f in dataclasses.fields(ModelOutput)], meta_fields=[])


class CausalLM(nnx.Module):
    """A causal LM of any known family. `config` decides the family, sizes and every layer's attention type."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        if rngs is None and not _ABSTRACT.get():  # abstract parameters draw no keys (nnx.Rngs costs a compile)
            rngs = nnx.Rngs(0)
        self.config = config
        self.embed_tokens = _declared(config, "embed_tokens", _normal, rngs, dtype)
        self.layers = nnx.List([DecoderLayer(config, t, dtype=dtype, rngs=rngs) for t in config.layer_types])
        self.norm = RMSNorm(config, "norm.scale", dtype=dtype, rngs=rngs)
        if config.unties_head:
            self.lm_head = _declared(config, "lm_head", _normal, rngs, dtype)

    @property
    def dtype(self):
        return self.embed_tokens[...].dtype

    def embed(self, input_ids: jax.Array) -> jax.Array:
        table = self.embed_tokens[...]
        if not self.config.scales_embeddings:
            return table[input_ids]
        # The scale is cast to the weight dtype first, as in transformers (bf16 rounds sqrt(3072) to 55.5).
        return table[input_ids] * jnp.asarray(math.sqrt(self.config.hidden_size), table.dtype)

    def shardings(self, mesh) -> nnx.State:
        """Where every variable goes on `mesh` (NamedSharding leaves, the tree of `nnx.state(self)`)."""
        return model_shardings(self, mesh)

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

    def layer_inputs(self, input_ids: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
        """What the first layer of a plain causal pass over unpadded rows takes: the embedded tokens (B, T, D),
        the positions and one attention mask per attention type. Each `layers[i](x, positions,
        masks[layers[i].attention_type], captured)` then gives the next layer's input, for work done one layer at a
        time over many rows (surgery's least-squares refit)."""
        positions, masks, _ = self._masks(input_ids.shape, None, None, None, None)
        return self.embed(input_ids), positions, masks

    def __call__(self, input_ids: jax.Array, *, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 capture: Iterable[str] = (), return_logits: bool = True, inputs_embeds: jax.Array | None = None,
                 cache: KVCache | None = None, skip_layers=None, remat: str | None = None,
                 attention_kernel: str = "xla") -> ModelOutput:
        """`input_ids` (B, T) int. `attention_mask` (B, T) marks real tokens (1) vs padding (0), as in transformers.
        `segment_ids` (B, T) int marks packed documents (0: padding): a token sees only earlier tokens of its own
        document; `positions` then count from 0 in each document (derived from `segment_ids` when not given).
        `capture` names intermediates to return (see CAPTURABLE). `inputs_embeds` (B, T, D), when given, replaces
        `self.embed(input_ids)` (already scaled by sqrt(D)): a training step can then differentiate the embedding
        lookup itself, e.g. to add its gradient straight into the tied LM head's. `cache` (`init_cache`): the tokens
        continue the cached ones (positions too, unless given); the output's `cache` holds them as well.
        `skip_layers`: layer indices to replace by the identity, or a (L,) bool array (traced: one compilation
        serves every choice of layers). `remat`: "layers" or "layers_dots", each layer under its own
        `jax.checkpoint` (nnx_surgery/surgery/modeling/layer_remat.py), for training. `attention_kernel`: "splash"
        runs attention through the Pallas splash kernel of a TPU (splash.py) where its masks apply (no cache, no
        captured attention probabilities, documents by `segment_ids` or none, 128-multiple lengths), else "xla";
        "splash_interpret" is the same kernel interpreted, for tests off a TPU."""
        capture = frozenset(capture)
        check_remat(remat, cache)
        positions_given = positions is not None
        if not capture <= CAPTURABLE:
            raise ValueError(f"capture={sorted(capture - CAPTURABLE)} unknown; choose from {sorted(CAPTURABLE)}.")
        captured = {name: [] for name in capture} if capture else None
        positions, masks, step = self._masks(input_ids.shape, positions, attention_mask, segment_ids, cache)
        if attention_kernel != "xla" and self._splash_applies(input_ids.shape, positions_given, segment_ids,
                                                              capture, cache, attention_kernel):
            masks = self._segment_masks(input_ids.shape, attention_mask, segment_ids, attention_kernel)
        x = batch_sharded(self.embed(input_ids) if inputs_embeds is None else inputs_embeds)
        residual = [x] if "residual" in capture else None
        skip = _skip_flags(skip_layers, len(self.layers), cache)
        for i, layer in enumerate(self.layers):
            if skip[i] is True:
                out = x
            elif remat is not None:
                out = checkpointed_layer(layer, x, positions, masks[layer.attention_type], captured, remat)
            else:
                out = layer(x, positions, masks[layer.attention_type], captured,
                            None if step is None else step.layer(i))
            x = batch_sharded(jnp.where(skip[i], x, out) if isinstance(skip[i], jax.Array) else out)
            if residual is not None:
                residual.append(x)
        final_hidden = self.norm(x)
        logits = self.logits_from_hidden(final_hidden) if return_logits else None
        extras = {name: tuple(values) for name, values in (captured or {}).items() if name != "residual"}
        return ModelOutput(logits=logits, final_hidden=final_hidden,
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

    def _splash_applies(self, shape, positions_given: bool, segment_ids, capture, cache, kernel: str) -> bool:
        """The splash kernel's index masks equal the dense ones: positions count from 0 in each document (derived,
        or given with `segment_ids` as packed rows give them), nothing asks for the probabilities, no cache."""
        if kernel not in KERNELS:
            raise ValueError(f"attention_kernel={kernel!r} unknown; choose from {', '.join(KERNELS)}.")
        head_dim = self.config.head_dim
        return (cache is None and "attention_probs" not in capture and (segment_ids is not None or not positions_given)
                and applies(shape[1], head_dim) and splash_available(shape[0]))

    def _segment_masks(self, shape, padding, segment_ids, kernel: str) -> dict:
        """One `SegmentMask` per attention type: documents by `segment_ids`, else the padding mask (0: padding)."""
        if segment_ids is None:
            segment_ids = jnp.ones(shape, jnp.int32) if padding is None else padding.astype(jnp.int32)
        interpret = kernel == "splash_interpret"
        return {layer.attention_type: SegmentMask(segment_ids, layer.self_attn.window, interpret)
                for layer in self.layers}

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache for `batch` rows of up to `max_len` tokens (prompt, padding and generated) in `dtype`
        (default: the model's). Full-attention layers get `max_len` slots, sliding layers a ring of the window."""
        attention = [layer.self_attn for layer in self.layers]
        layers = [(a.window, a.attention_type, a.num_kv_heads, a.head_dim) for a in attention]
        return KVCache.create(layers, batch, max_len, self.dtype if dtype is None else dtype)


# ------------------------------------------------------------------------------------------------ functions
def _skip_flags(skip_layers, num_layers: int, cache) -> list:
    """Per layer: False (run it), True (skip it, static) or a traced bool scalar."""
    if skip_layers is None:
        return [False] * num_layers
    if cache is not None:
        raise ValueError("skip_layers cannot be combined with cache=; a skipped layer would leave its cache stale.")
    if getattr(skip_layers, "dtype", None) == jnp.bool_:
        skip_layers = jnp.asarray(skip_layers)
        if skip_layers.shape != (num_layers,):
            raise ValueError(f"skip_layers as an array must have shape ({num_layers},), got {skip_layers.shape}.")
        return [skip_layers[i] for i in range(num_layers)]
    chosen = {int(i) for i in skip_layers}
    if not chosen <= set(range(num_layers)):
        raise ValueError(f"skip_layers {sorted(chosen)} must be layer indices in [0, {num_layers}).")
    return [i in chosen for i in range(num_layers)]


def create_model(config: ModelConfig, *, dtype=jnp.float32, seed: int = 0, mesh=None) -> CausalLM:
    """A randomly initialised model (normal(0.02) weights, norms the identity), sharded over `mesh` when given."""
    if mesh is None:
        return CausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))
    with jax.set_mesh(mesh):
        return CausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed))


def abstract_model(config: ModelConfig, *, dtype=jnp.float32, mesh=None) -> CausalLM:
    """The model's structure with ShapeDtypeStruct leaves (sharded like `create_model`'s under `mesh`): no memory
    is allocated and no initialiser runs, so it costs milliseconds even for a 7B config."""
    token = _ABSTRACT.set(True)
    try:
        if mesh is None:
            return CausalLM(config, dtype=dtype)
        with jax.set_mesh(mesh):
            return CausalLM(config, dtype=dtype)
    finally:
        _ABSTRACT.reset(token)


__all__ = ["CausalLM", "ModelOutput", "KVCache", "create_model", "abstract_model",
           "apply_rope", "rope_frequencies", "attention_mask", "segment_positions", "softcap", "fitted_spec",
           "parameter_sharding", "CAPTURABLE", "FULL", "SLIDING"]
