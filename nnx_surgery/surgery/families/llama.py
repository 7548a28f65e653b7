"""Llama (`llama`), Mistral (`mistral`) and Qwen2 (`qwen2`): tensor schema, config adapter and divisibility rule.

What sets them apart from Gemma: RMSNorm weights act as `w` (not `1 + w`, initialised to ones, and the
normalised activations are cast back to the input dtype before the weight multiplies them), embeddings are not
scaled, the MLP is SwiGLU (`silu(gate) * up`), attention scales by `head_dim ** -0.5`, no soft-caps, and the
LM head is untied by default. Within the family:

* `llama`    RoPE `default`, `linear` or `llama3`; `attention_bias` adds biases to q/k/v and o_proj.
* `mistral`  a sliding window on every layer when `sliding_window` is set (the class default is 4096).
* `qwen2`    biases on q/k/v (never on o_proj); with `use_sliding_window`, layers from `max_window_layers` on slide.

No GGUF conversion (`NO_GGUF` says why): llama.cpp's converter permutes Llama's q/k rows into its RoPE layout,
and neither undoing nor redoing that is built here, so the schema names no GGUF tensors either.
"""
from __future__ import annotations

from typing import Any

from nnx_surgery.surgery.families.config_values import (FULL, SLIDING, ConfigError, Numbers, layer_types_given,
                                                        legacy_rope)
from nnx_surgery.surgery.families.schema import Tensor
from .base import Family

H, G = ("heads", "head_dim"), ("kv_heads", "head_dim")
P = "model.layers.{i}."
TENSORS = (
    Tensor("model.embed_tokens.weight", ("vocab", "embed"), role="embedding"),
    Tensor(P + "input_layernorm.weight", ("embed",), norm=True, reads="residual"),
    Tensor(P + "self_attn.q_proj.weight", H + ("embed",), (H, ("embed",))),
    Tensor(P + "self_attn.q_proj.bias", H, (H,), when="attention_bias"),
    Tensor(P + "self_attn.k_proj.weight", G + ("embed",), (G, ("embed",))),
    Tensor(P + "self_attn.k_proj.bias", G, (G,), when="attention_bias"),
    Tensor(P + "self_attn.v_proj.weight", G + ("embed",), (G, ("embed",))),
    Tensor(P + "self_attn.v_proj.bias", G, (G,), when="attention_bias"),
    Tensor(P + "self_attn.o_proj.weight", ("embed",) + H, (("embed",), H)),
    Tensor(P + "self_attn.o_proj.bias", ("embed",), when="output_bias"),
    Tensor(P + "post_attention_layernorm.weight", ("embed",), norm=True, reads="mid_residual"),
    Tensor(P + "mlp.gate_proj.weight", ("mlp", "embed")),
    Tensor(P + "mlp.up_proj.weight", ("mlp", "embed")),
    Tensor(P + "mlp.down_proj.weight", ("embed", "mlp")),
    Tensor("model.norm.weight", ("embed",), norm=True, reads="final_residual"),
    Tensor("lm_head.weight", ("vocab", "embed"), role="head", when="unties_head"),
)

_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, final_logit_softcapping=None, hidden_act="silu")
# The transformers 5 config-class defaults (LlamaConfig, MistralConfig, Qwen2Config).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32),
    "mistral": dict(_COMMON, vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, sliding_window=4096),
    "qwen2": dict(_COMMON, vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, sliding_window=4096, max_window_layers=28),
}


def read(values: dict, model_type: str, number: Numbers, where: str) -> dict[str, Any]:
    """The family-specific ModelConfig fields of a config dict (defaults already merged in)."""
    act = values.get("hidden_act")
    if act not in ("silu", "swish"):
        raise ConfigError(f"{where}: hidden_act={act!r} is not supported for {model_type}; the Llama family uses "
                          "SwiGLU ('silu').")
    if values.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true is not supported (no released Llama-family model uses it).")
    if float(values.get("partial_rotary_factor") or 1.0) != 1.0 or \
            float((values.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor != 1 is not supported.")
    num_layers = number.int("num_hidden_layers")
    fields: dict[str, Any] = {"hidden_act": "silu", "rope": {}}
    if model_type == "llama":
        bias = number.bool("attention_bias", False)
        fields.update(attention_bias=bias, output_bias=bias)
    elif model_type == "qwen2":
        fields.update(attention_bias=True, output_bias=False)
    window = None
    if model_type == "mistral" or (model_type == "qwen2" and number.bool("use_sliding_window", False)):
        window = number.int("sliding_window", None)
    fields["sliding_window"] = window
    given = layer_types_given(values, num_layers, where)
    if given is None and model_type == "qwen2":
        start = number.int("max_window_layers")
        given = tuple(SLIDING if window is not None and i >= start else FULL for i in range(num_layers))
    fields["layer_types"] = given or ((SLIDING if window is not None else FULL),) * num_layers
    rope = legacy_rope(values, 10_000.0, where)
    fields["rope"] = {FULL: rope, SLIDING: rope}
    return fields


def write(config, out: dict[str, Any]) -> None:
    out.pop("hidden_activation", None)
    out["hidden_act"] = "silu"
    rope = config.rope[FULL]
    out["rope_parameters"] = rope.to_hf()
    out["rope_theta"] = rope.theta
    out.pop("rope_scaling", None)
    if config.model_type in ("llama", "mistral"):  # all-full or all-sliding: the class derives it
        out.pop("layer_types", None)
    if config.model_type == "llama":
        out["attention_bias"] = config.attention_bias
        out["mlp_bias"] = False
    if config.model_type == "mistral":
        out["sliding_window"] = config.sliding_window
    if config.model_type == "qwen2":
        out["use_sliding_window"] = config.sliding_window is not None and SLIDING in config.layer_types
        out["sliding_window"] = config.sliding_window
        out["max_window_layers"] = next((i for i, t in enumerate(config.layer_types) if t == SLIDING),
                                        config.num_hidden_layers)


def validate(config, where: str) -> None:
    if config.model_type == "mistral" and len(set(config.layer_types)) > 1:
        raise ConfigError(f"{where}: a mistral model slides on every layer or none; mixed layer_types are "
                          "Ministral's.")


NO_GGUF = "llama.cpp permutes Llama-family q/k rows for its RoPE layout, and undoing that is not built here"

FAMILY = Family(
    name="llama", architectures={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                                 "qwen2": "Qwen2ForCausalLM"},
    tensors=TENSORS, defaults=DEFAULTS, normalise=lambda data, where: data, read=read, write=write,
    validate=validate, attention_scale=lambda config: config.head_dim ** -0.5, norm_offset=False,
    scales_embeddings=False,
    # transformers' LlamaConfig checks the rule; MistralConfig and Qwen2Config take head_dim as given
    hidden_multiple_of_heads=frozenset({"llama"}), no_gguf=NO_GGUF)
