"""Gemma 1 (`gemma`), 2 (`gemma2`) and 3 (`gemma3_text`): tensor schema, config adapter, divisibility rule and
GGUF conversion (llama.cpp's `gemma`, `gemma2` and `gemma3` architectures).

The three differ in small ways that change the logits:

* `gemma`        all layers global, attention scale `head_dim ** -0.5`, one pre-MLP norm
                 (`post_attention_layernorm`, despite its name).
* `gemma2`       sandwich norms (the attention output and the MLP are normalised before they join the residual),
                 attention and final soft-caps, alternating sliding/full layers, scale `query_pre_attn_scalar`.
* `gemma3_text`  q/k RMSNorm before RoPE, local/global RoPE bases, linear RoPE scaling on full layers only, and no
                 attention soft-cap even if the field is set (transformers stores it but never applies it).

All three: RMSNorm weights applied as `(1 + w)`, embeddings multiplied by sqrt(hidden_size), tanh GELU.

GGUF: the file states sizes, RoPE bases and (Gemma 2) soft-caps; what it leaves out takes transformers'
config-class defaults (`query_pre_attn_scalar` 256, Gemma 3's sliding RoPE base 10000, the layer pattern: Gemma 2
alternates, Gemma 3 has one full layer in six). Two facts a file can state that transformers' GGUF loader drops are
kept, since llama.cpp applies them: Gemma 2's soft-caps and Gemma 3's linear RoPE scaling of full layers (released
Gemma 2 files state the soft-caps transformers assumes, 50 and 30, and Gemma 3 270M/1B have no scaling, so there the
configs are identical). transformers reads no Gemma 1 GGUF; its config is built the same way from the same keys.
llama.cpp's converter leaves Gemma's q/k rows unpermuted, so tensors move as they are. llama.cpp fixes Gemma 2/3's
attention scale at 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the 27B models, which it knows by their depth), so an
export folds any other scale into the queries (`gguf_query_scale`). What its Gemma graphs cannot express is refused
before anything is written (`gguf_check`).
"""
from __future__ import annotations

from typing import Any

import math

from nnx_surgery.surgery.families.config_values import (FULL, SLIDING, ConfigError, Numbers, Rope, layer_types_given,
                                                        legacy_rope, pattern_of, rope_entry)
from nnx_surgery.surgery.families.errors import CheckpointError
from nnx_surgery.surgery.families.schema import Tensor
from .base import Family, GGUFFormat, GGUFKeys

H, G = ("heads", "head_dim"), ("kv_heads", "head_dim")
P = "model.layers.{i}."
TENSORS = (
    Tensor("model.embed_tokens.weight", ("vocab", "embed"), role="embedding", gguf="token_embd.weight"),
    Tensor(P + "input_layernorm.weight", ("embed",), norm=True, reads="residual", gguf="blk.{i}.attn_norm.weight"),
    Tensor(P + "self_attn.q_proj.weight", H + ("embed",), (H, ("embed",)), gguf="blk.{i}.attn_q.weight"),
    Tensor(P + "self_attn.k_proj.weight", G + ("embed",), (G, ("embed",)), gguf="blk.{i}.attn_k.weight"),
    Tensor(P + "self_attn.v_proj.weight", G + ("embed",), (G, ("embed",)), gguf="blk.{i}.attn_v.weight"),
    Tensor(P + "self_attn.o_proj.weight", ("embed",) + H, (("embed",), H), gguf="blk.{i}.attn_output.weight"),
    Tensor(P + "self_attn.q_norm.weight", ("head_dim",), norm=True, when="uses_qk_norm",
           gguf="blk.{i}.attn_q_norm.weight"),
    Tensor(P + "self_attn.k_norm.weight", ("head_dim",), norm=True, when="uses_qk_norm",
           gguf="blk.{i}.attn_k_norm.weight"),
    # Gemma 1: the pre-MLP norm, reading the residual after attention (llama.cpp's ffn_norm).
    Tensor(P + "post_attention_layernorm.weight", ("embed",), norm=True, reads="mid_residual",
           when="!uses_sandwich_norms", gguf="blk.{i}.ffn_norm.weight"),
    # Gemma 2/3: the same name normalises the attention output.
    Tensor(P + "post_attention_layernorm.weight", ("embed",), norm=True, reads="attention_outputs",
           when="uses_sandwich_norms", gguf="blk.{i}.post_attention_norm.weight"),
    Tensor(P + "pre_feedforward_layernorm.weight", ("embed",), norm=True, reads="mid_residual",
           when="uses_sandwich_norms", gguf="blk.{i}.ffn_norm.weight"),
    Tensor(P + "post_feedforward_layernorm.weight", ("embed",), norm=True, reads="mlp_outputs",
           when="uses_sandwich_norms", gguf="blk.{i}.post_ffw_norm.weight"),
    Tensor(P + "mlp.gate_proj.weight", ("mlp", "embed"), gguf="blk.{i}.ffn_gate.weight"),
    Tensor(P + "mlp.up_proj.weight", ("mlp", "embed"), gguf="blk.{i}.ffn_up.weight"),
    Tensor(P + "mlp.down_proj.weight", ("embed", "mlp"), gguf="blk.{i}.ffn_down.weight"),
    Tensor("model.norm.weight", ("embed",), norm=True, reads="final_residual", gguf="output_norm.weight"),
    Tensor("lm_head.weight", ("vocab", "embed"), role="head", when="unties_head", gguf="output.weight"),
)

_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=True, final_logit_softcapping=None)
# The transformers 5 config-class defaults, used for keys a config.json leaves out (as transformers does).
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": dict(_COMMON, vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256),
    "gemma2": dict(_COMMON, vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(_COMMON, vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                        sliding_window=4096),
}
TANH_GELU = frozenset({"gelu_pytorch_tanh", "gelu_new"})  # Gemma 1's legacy "gelu" means tanh as well


def normalise(data: dict, where: str) -> dict:
    """A multimodal Gemma 3 (`gemma3`) keeps the text model under `text_config`: that, as `gemma3_text`."""
    if data.get("model_type") != "gemma3":
        return data
    text = data.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: a multimodal 'gemma3' config needs a text_config object.")
    text = dict(text, model_type="gemma3_text")
    text.setdefault("tie_word_embeddings", data.get("tie_word_embeddings", True))
    return text


def read(values: dict, model_type: str, number: Numbers, where: str) -> dict[str, Any]:
    """The Gemma-specific ModelConfig fields of a config dict (defaults already merged in)."""
    key = "hidden_act" if model_type == "gemma" else "hidden_activation"
    act = values.get(key) or "gelu_pytorch_tanh"
    if not isinstance(act, str) or act not in TANH_GELU | ({"gelu"} if model_type == "gemma" else set()):
        raise ConfigError(f"{where}: {key}={act!r} is not supported; Gemma uses the tanh GELU "
                          "('gelu_pytorch_tanh').")
    if values.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention=True (embedding models) is not supported.")
    fields: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh"}
    if model_type != "gemma":
        fields["query_pre_attn_scalar"] = number.int_or_float("query_pre_attn_scalar")  # int in transformers 5
        fields["sliding_window"] = number.int("sliding_window", None)
    if model_type == "gemma2":
        fields["attn_logit_softcapping"] = number.float("attn_logit_softcapping", None)
    num_layers = number.int("num_hidden_layers")
    fields["layer_types"] = layer_types_given(values, num_layers, where) or _layer_types(values, model_type,
                                                                                          num_layers, where)
    fields["rope"] = _rope(values, model_type, where)
    return fields


def _layer_types(data: dict, model_type: str, num_layers: int, where: str) -> tuple[str, ...]:
    if model_type == "gemma":
        return (FULL,) * num_layers
    if model_type == "gemma2":
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    pattern = data.get("sliding_window_pattern") or data.get("_sliding_window_pattern") or 6
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"{where}: sliding_window_pattern={pattern!r} must be a positive integer.")
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def _rope(data: dict, model_type: str, where: str) -> dict[str, Rope]:
    if model_type != "gemma3_text":
        one = legacy_rope(data, 10_000.0, where)
        if one.kind == "llama3":
            raise ConfigError(f"{where}: rope_type 'llama3' is not a Gemma RoPE; use 'default' or 'linear'.")
        return {FULL: one, SLIDING: one}
    params = data.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        return {FULL: rope_entry(params.get(FULL), 1_000_000.0, where),
                SLIDING: rope_entry(params.get(SLIDING), 10_000.0, where)}
    full = legacy_rope({k: v for k, v in data.items() if k != "rope_parameters"}, 1_000_000.0, where)
    return {FULL: full, SLIDING: Rope(Numbers(data, where).float("rope_local_base_freq", 10_000.0))}


def write(config, out: dict[str, Any]) -> None:
    """The Gemma-specific keys of a config.json that transformers 5 and 4.5x both read the same way."""
    out.setdefault("hidden_activation", "gelu_pytorch_tanh")
    if config.model_type == "gemma":
        out["hidden_act"] = "gelu_pytorch_tanh"
    else:
        out["query_pre_attn_scalar"] = config.query_pre_attn_scalar
        out["sliding_window"] = config.sliding_window
        out["attn_logit_softcapping"] = config.attn_logit_softcapping
    full = config.rope[FULL]
    if config.model_type == "gemma3_text":
        out["rope_parameters"] = {t: config.rope[t].to_hf() for t in (SLIDING, FULL)}
        out["rope_local_base_freq"] = config.rope[SLIDING].theta
        pattern = pattern_of(config.layer_types)
        for key in ("sliding_window_pattern", "_sliding_window_pattern"):
            if pattern:
                out[key] = pattern
            else:
                out.pop(key, None)
    else:
        out["rope_parameters"] = full.to_hf()
    out["rope_theta"] = full.theta
    out["rope_scaling"] = {"rope_type": "linear", "factor": full.factor} if full.linear_factor != 1.0 else None


def attention_scale(config) -> float:
    if config.model_type == "gemma":
        return config.head_dim ** -0.5
    return float(config.query_pre_attn_scalar) ** -0.5


def validate(config, where: str) -> None:
    if config.model_type == "gemma3_text" and SLIDING not in config.rope:
        raise ConfigError(f"{where}: rope has no entry for {SLIDING!r}; give a Rope per attention type.")


# ------------------------------------------------------------------------------------------------ GGUF
# Layer counts llama.cpp takes for the 27B models, whose attention scale it derives from hidden / heads.
LAYERS_OF_27B = {"gemma2": 46, "gemma3_text": 62}


def gguf_read(model_type: str, keys: GGUFKeys, config: dict[str, Any]) -> dict[str, Any]:
    """The Gemma keys of the transformers config a GGUF file describes (see the module docstring)."""
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
    if model_type == "gemma":
        out["hidden_act"] = "gelu_pytorch_tanh"
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(keys("rope.freq_base", 10000.0))}
        return out
    out.update(query_pre_attn_scalar=256, sliding_window=int(keys("attention.sliding_window", 4096)))
    layers = config["num_hidden_layers"]
    if model_type == "gemma2":
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": float(keys("rope.freq_base", 10000.0))}
        out["attn_logit_softcapping"] = float(keys("attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = float(keys("final_logit_softcapping", 30.0))
        out["layer_types"] = _gguf_layer_types(keys, layers, 2)
        return out
    full = {"rope_type": "default", "rope_theta": float(keys("rope.freq_base", 1_000_000.0))}
    scaling = keys("rope.scaling.type", None)
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise CheckpointError(f"{keys.where}: {keys.arch}.rope.scaling.type={scaling!r}; Gemma 3 uses 'linear' "
                                  "only.")
        full.update(rope_type="linear", factor=float(keys("rope.scaling.factor")))
    out["rope_parameters"] = {"full_attention": full,
                              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    out.update(attn_logit_softcapping=None, final_logit_softcapping=None)
    out["layer_types"] = _gguf_layer_types(keys, layers, 6)
    return out


def _gguf_layer_types(keys: GGUFKeys, num_layers: int, default_pattern: int) -> list[str]:
    """Sliding/full per layer: `attention.sliding_window_pattern` (a period, or one flag per layer, True =
    sliding) when the file has it, else every `default_pattern`-th layer full (transformers' default)."""
    pattern = keys("attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        return [SLIDING if flag else FULL for flag in pattern]
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise CheckpointError(f"{keys.where}: {keys.arch}.attention.sliding_window_pattern = {pattern!r} is not a "
                              "period of layers (a whole number from 1) or one flag per layer; the file's header is "
                              "corrupt.")
    return [SLIDING if (i + 1) % int(pattern) else FULL for i in range(num_layers)]


def gguf_check(config, where: str) -> None:
    """A CheckpointError for what llama.cpp's Gemma graphs cannot express."""
    if config.unties_head and config.model_type != "gemma3_text":
        raise CheckpointError(f"{where}: tie_word_embeddings=false, but llama.cpp's {config.model_type} model always "
                              "uses token_embd as the output layer; tie the head (or export a Gemma 3).")
    if config.model_type == "gemma2" and (config.attn_logit_softcapping is None
                                          or config.final_logit_softcapping is None):
        raise CheckpointError(f"{where}: a Gemma 2 without attention or final soft-capping; llama.cpp always applies "
                              "both (set attn_logit_softcapping and final_logit_softcapping).")
    sliding = config.rope.get(SLIDING)
    if config.model_type == "gemma3_text" and SLIDING in config.layer_types and sliding.kind != "default":
        raise CheckpointError(f"{where}: RoPE {sliding.kind!r} on sliding layers; llama.cpp scales only Gemma 3's "
                              "full-attention layers (use a default RoPE for sliding_attention).")
    if config.model_type == "gemma2" and config.rope[FULL] != sliding:
        raise CheckpointError(f"{where}: different RoPE for sliding and full layers; Gemma 2 in llama.cpp has one.")


def gguf_write(writer, config) -> None:
    """The Gemma `<arch>.*` keys: sliding window and per-layer pattern, Gemma 3's local RoPE base, soft-caps."""
    sliding = [kind == SLIDING for kind in config.layer_types]
    if config.model_type == "gemma2" or (config.model_type == "gemma3_text" and any(sliding)):
        # an all-full Gemma 2 still states a window (llama.cpp's Gemma 2 always has one): transformers' default
        writer.add_sliding_window(int(config.sliding_window or DEFAULTS["gemma2"]["sliding_window"]))
        # one flag per layer: llama.cpp reads a number as a period, and a depth-pruned student's follow none
        writer.add_sliding_window_pattern(sliding)
    if config.model_type == "gemma3_text" and any(sliding):
        writer.add_rope_freq_base_swa(config.rope[SLIDING].theta)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if config.model_type != "gemma" and config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def gguf_query_scale(config) -> float:
    """What the queries must be multiplied by for llama.cpp's fixed attention scale to give the model's."""
    if config.model_type == "gemma":
        return 1.0
    if config.num_hidden_layers == LAYERS_OF_27B[config.model_type]:
        fixed = 1.0 / math.sqrt(float(config.hidden_size // config.num_attention_heads))
    else:
        fixed = 1.0 / math.sqrt(float(config.head_dim))
    return 1.0 if math.isclose(config.attention_scale, fixed, rel_tol=1e-12) else config.attention_scale / fixed


GGUF = GGUFFormat(
    architectures={"gemma": "gemma", "gemma2": "gemma2", "gemma3": "gemma3_text"}, read=gguf_read,
    check=gguf_check, write=gguf_write, query_scale=gguf_query_scale,
    context_lengths={"gemma": 8192, "gemma2": 8192, "gemma3_text": 131072})

FAMILY = Family(
    name="gemma", architectures={"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                 "gemma3_text": "Gemma3ForCausalLM"},
    tensors=TENSORS, defaults=DEFAULTS, normalise=normalise, read=read, write=write, validate=validate,
    attention_scale=attention_scale, norm_offset=True, scales_embeddings=True,
    sandwich_norms=frozenset({"gemma2", "gemma3_text"}), qk_norm=frozenset({"gemma3_text"}),
    attention_softcap=frozenset({"gemma2"}),
    # transformers' Gemma 2/3 configs check the rule although head_dim is explicit; Gemma 1's does not
    hidden_multiple_of_heads=frozenset({"gemma2", "gemma3_text"}), gguf=GGUF)
