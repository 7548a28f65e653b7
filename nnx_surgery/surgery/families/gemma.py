"""Gemma 1 (`gemma`), 2 (`gemma2`) and 3 (`gemma3_text`): tensor schema and config adapter.

The three differ in small ways that change the logits:

* `gemma`        all layers global, attention scale `head_dim ** -0.5`, one pre-MLP norm
                 (`post_attention_layernorm`, despite its name).
* `gemma2`       sandwich norms (the attention output and the MLP are normalised before they join the residual),
                 attention and final soft-caps, alternating sliding/full layers, scale `query_pre_attn_scalar`.
* `gemma3_text`  q/k RMSNorm before RoPE, local/global RoPE bases, linear RoPE scaling on full layers only, and no
                 attention soft-cap even if the field is set (transformers stores it but never applies it).

All three: RMSNorm weights applied as `(1 + w)`, embeddings multiplied by sqrt(hidden_size), tanh GELU.
"""
from __future__ import annotations

from typing import Any

from ..config_values import FULL, SLIDING, ConfigError, Numbers, Rope, layer_types_given, legacy_rope, \
    pattern_of, rope_entry
from ..schema import Tensor
from .base import Family

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
    if config.model_type != "gemma" and config.hidden_size % config.num_attention_heads:
        raise ConfigError(
            f"{where}: hidden_size={config.hidden_size} is not a multiple of num_attention_heads="
            f"{config.num_attention_heads}; transformers rejects such Gemma 2/3 configs although head_dim is explicit.")
    if config.model_type == "gemma3_text" and SLIDING not in config.rope:
        raise ConfigError(f"{where}: rope has no entry for {SLIDING!r}; give a Rope per attention type.")


FAMILY = Family(
    name="gemma", architectures={"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                 "gemma3_text": "Gemma3ForCausalLM"},
    tensors=TENSORS, defaults=DEFAULTS, normalise=normalise, read=read, write=write, validate=validate,
    attention_scale=attention_scale, norm_offset=True, scales_embeddings=True,
    sandwich_norms=frozenset({"gemma2", "gemma3_text"}), qk_norm=frozenset({"gemma3_text"}),
    attention_softcap=frozenset({"gemma2"}), gguf_architectures={"gemma": "gemma", "gemma2": "gemma2",
                                                                 "gemma3": "gemma3_text"})
