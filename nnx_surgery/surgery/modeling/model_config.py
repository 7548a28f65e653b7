"""Model configuration, read from and written back to Hugging Face `config.json`.

`config.json` is the only source of truth: every size, the attention type of every layer, the RoPE settings,
soft-caps and the attention scale come from it, never from a table of model sizes. What is particular to a
family (Gemma 1/2/3; Llama, Mistral, Qwen2) lives in its adapter, `nnx_surgery/surgery/families/`: its config-class defaults,
the keys it reads and writes, its tensor schema and its divisibility rule. `ModelConfig` holds the result.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any

from nnx_surgery.surgery.families.config_values import FULL, SLIDING, ConfigError, Numbers, Rope
from ..families import ARCHITECTURES, BY_MODEL_TYPE, SUPPORTED_MODEL_TYPES, Family
from nnx_surgery.surgery.families.schema import bound_tensors, nnx_shape

FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {t: d for f in BY_MODEL_TYPE.values() for t, d in f.defaults.items()}
# Keys whose explicit null still means "the default" (elsewhere null means "off", e.g. a soft-cap).
_NULL_MEANS_DEFAULT = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings",
                                 "query_pre_attn_scalar", "hidden_act"})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rope: dict[str, Rope]  # keyed by attention type
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float | None = None  # Gemma 2/3; the others scale by head_dim
    attn_logit_softcapping: float | None = None  # used by Gemma 2 only
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    tie_word_embeddings: bool = True
    hidden_act: str = "gelu_pytorch_tanh"  # "gelu_pytorch_tanh" (GeGLU) or "silu" (SwiGLU)
    attention_bias: bool = False  # biases on q/k/v_proj
    output_bias: bool = False  # a bias on o_proj
    raw: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # `replace(layer_types=[...])` too
        validate_config(self)

    def __hash__(self) -> int:  # `rope` and `raw` are dicts; modules holding a config must stay hashable
        return hash(json.dumps(self.to_hf_dict(), sort_keys=True, default=str))

    # ---------------------------------------------------------------------------------------------- derived
    @property
    def family(self) -> Family:
        return BY_MODEL_TYPE[self.model_type]

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head: query head h uses KV head h // num_query_groups."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        return self.family.attention_scale(self)

    @property
    def uses_sandwich_norms(self) -> bool:
        return self.model_type in self.family.sandwich_norms

    @property
    def uses_qk_norm(self) -> bool:
        return self.model_type in self.family.qk_norm

    @property
    def attention_softcap(self) -> float | None:
        return self.attn_logit_softcapping if self.model_type in self.family.attention_softcap else None

    @property
    def unties_head(self) -> bool:
        return not self.tie_word_embeddings

    @property
    def scales_embeddings(self) -> bool:
        """Embeddings are multiplied by sqrt(hidden_size) (Gemma)."""
        return self.family.scales_embeddings

    @property
    def norm_offset(self) -> bool:
        """RMSNorm weights act as (1 + w) (Gemma; zero-initialised) rather than w (Llama; one-initialised)."""
        return self.family.norm_offset

    @property
    def embedding_multiplier(self) -> float | None:
        return math.sqrt(self.hidden_size) if self.scales_embeddings else None

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        return sum(math.prod(nnx_shape(self, t)) for t in bound_tensors(self))

    # ---------------------------------------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], *, where: str = "config.json") -> "ModelConfig":
        """Read a transformers config dict. Missing keys take the transformers class defaults (the family's
        `defaults`), as transformers itself does: the multimodal Gemma 3 configs on the Hub list only what differs
        from them (gemma-3-4b's `text_config` has no `vocab_size`, `num_attention_heads` or `head_dim`)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a JSON object, found {type(data).__name__}.")
        data = copy.deepcopy(data)
        for family in BY_MODEL_TYPE.values():
            data = family.normalise(data, where)
        model_type = data.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{where}: model_type {model_type!r} is not supported; expected one of "
                              f"{SUPPORTED_MODEL_TYPES} (or a multimodal 'gemma3' with a text_config).")
        family = BY_MODEL_TYPE[model_type]
        given = {k: v for k, v in data.items() if v is not None or k not in _NULL_MEANS_DEFAULT}
        values = {**family.defaults[model_type], **given}
        number = Numbers(values, where)
        hidden, heads = number.int("hidden_size"), number.int("num_attention_heads")
        kwargs = dict(
            model_type=model_type,
            vocab_size=number.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=number.int("intermediate_size"),
            num_hidden_layers=number.int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=number.int("num_key_value_heads", heads),
            head_dim=number.int("head_dim", hidden // heads if heads > 0 else 0),
            rms_norm_eps=number.float("rms_norm_eps"),
            tie_word_embeddings=number.bool("tie_word_embeddings"),
            final_logit_softcapping=number.float("final_logit_softcapping", None),
        )
        kwargs.update(family.read(values, model_type, number, where))
        try:
            return cls(**kwargs, raw=data)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        """A config.json transformers reads back as this config (the family adds its own keys)."""
        out = {k: v for k, v in self.raw.items() if not k.startswith("_") or k == "_sliding_window_pattern"}
        for legacy in ("rope_scaling", "rope_local_base_freq", "text_config", "vision_config", "transformers_version"):
            out.pop(legacy, None)
        out.update(
            architectures=[ARCHITECTURES[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            layer_types=list(self.layer_types),
            final_logit_softcapping=self.final_logit_softcapping,
        )
        self.family.write(self, out)
        if dtype is not None:
            out["dtype"] = dtype
            out["torch_dtype"] = dtype
        return out

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ModelConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: not found; a Hugging Face model folder needs a config.json.") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err}).") from None
        return cls.from_hf_dict(data, where=path)


def validate_config(cfg: ModelConfig) -> None:
    where = f"{cfg.model_type} config"
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {cfg.model_type!r} is not supported; expected one of "
                          f"{SUPPORTED_MODEL_TYPES}.")
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")
    for name in positive:
        if int(getattr(cfg, name)) <= 0:
            raise ConfigError(f"{where}: {name}={getattr(cfg, name)} must be a positive integer.")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{where}: num_attention_heads={cfg.num_attention_heads} is not a multiple of num_key_value_heads="
            f"{cfg.num_key_value_heads}; every KV head must serve the same number of query heads.")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ConfigError(f"{where}: layer_types has {len(cfg.layer_types)} entries for "
                          f"num_hidden_layers={cfg.num_hidden_layers}.")
    unknown = set(cfg.layer_types) - {FULL, SLIDING}
    if unknown:
        raise ConfigError(f"{where}: unknown layer_types {sorted(unknown)}; expected {FULL!r} or {SLIDING!r}.")
    needed = {FULL} | set(cfg.layer_types)
    if needed - set(cfg.rope):
        raise ConfigError(f"{where}: rope has no entry for {sorted(needed - set(cfg.rope))}; give a Rope per "
                          "attention type.")
    if SLIDING in cfg.layer_types and not cfg.sliding_window:
        raise ConfigError(f"{where}: sliding layers need a positive sliding_window.")
    if cfg.hidden_act not in ("gelu_pytorch_tanh", "silu"):
        raise ConfigError(f"{where}: hidden_act={cfg.hidden_act!r}; expected 'gelu_pytorch_tanh' or 'silu'.")
    rule = cfg.family.broken_rule(cfg.model_type, cfg.hidden_size, cfg.num_attention_heads)
    if rule:
        raise ConfigError(f"{where}: hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads="
                          f"{cfg.num_attention_heads}; transformers rejects such {cfg.model_type} configs although "
                          f"head_dim is explicit (the {cfg.family.name} family's rule: {rule}).")
    cfg.family.validate(cfg, where)


__all__ = ["ModelConfig", "ConfigError", "Rope", "FULL", "SLIDING",
           "SUPPORTED_MODEL_TYPES", "ARCHITECTURES", "FAMILY_DEFAULTS"]
