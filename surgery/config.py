"""Gemma configuration, read from and written back to Hugging Face `config.json`.

`config.json` is the only source of truth: every size, the attention type of every layer, the RoPE bases,
soft-caps and the attention scale come from it, never from a table of model sizes. The three families differ in
small ways that change the logits (see `shared/research/hf_nnx.md` §1):

* `gemma`        (Gemma 1): all layers global, attention scale `head_dim ** -0.5`, pre-MLP norm only.
* `gemma2`       sandwich norms, attention and final soft-caps, alternating sliding/full layers.
* `gemma3_text`  q/k RMSNorm before RoPE, local/global RoPE bases, linear RoPE scaling on full layers only,
                 no attention soft-cap even if the field is set.

Multimodal Gemma 3 checkpoints (`model_type: gemma3`) keep the text model's config under `text_config`;
`GemmaConfig.from_hf_dict` reads that and the result is the text-only `gemma3_text` model.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any

SUPPORTED_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
FULL, SLIDING = "full_attention", "sliding_attention"
ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_COMMON_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=True, final_logit_softcapping=None)
# The transformers 5 config-class defaults, used for keys a config.json leaves out (as transformers does).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": dict(_COMMON_DEFAULTS, vocab_size=256000, hidden_size=3072, intermediate_size=24576,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16, head_dim=256),
    "gemma2": dict(_COMMON_DEFAULTS, vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                   num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0),
    "gemma3_text": dict(_COMMON_DEFAULTS, vocab_size=262208, hidden_size=2304, intermediate_size=9216,
                        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        query_pre_attn_scalar=256, sliding_window=4096),
}
# Keys whose explicit null still means "the default" (elsewhere null means "off", e.g. a soft-cap).
_NULL_MEANS_DEFAULT = frozenset({"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings",
                                 "query_pre_attn_scalar"})
# GELU with the tanh approximation under its transformers names; Gemma 1's legacy "gelu" means tanh as well.
TANH_GELU = frozenset({"gelu_pytorch_tanh", "gelu_new"})


class ConfigError(ValueError):
    """A config.json that cannot describe a Gemma this toolkit can run."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """RoPE for one attention type: base `theta`, and `linear_factor` dividing the inverse frequencies."""

    theta: float
    linear_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    rope: dict[str, RopeSpec]  # keyed by attention type
    rms_norm_eps: float = 1e-6
    query_pre_attn_scalar: float | None = None  # Gemma 2/3; Gemma 1 scales by head_dim
    attn_logit_softcapping: float | None = None  # used by Gemma 2 only
    final_logit_softcapping: float | None = None
    sliding_window: int | None = None
    tie_word_embeddings: bool = True
    raw: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))  # `replace(layer_types=[...])` too
        validate(self)

    def __hash__(self) -> int:  # `rope` and `raw` are dicts; modules holding a config must stay hashable
        return hash(json.dumps(self.to_hf_dict(), sort_keys=True, default=str))

    # ---------------------------------------------------------------------------------------------- derived
    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head: query head h uses KV head h // num_query_groups."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def attention_scale(self) -> float:
        if self.model_type == "gemma":
            return self.head_dim**-0.5
        return float(self.query_pre_attn_scalar) ** -0.5

    @property
    def uses_sandwich_norms(self) -> bool:
        return self.model_type != "gemma"

    @property
    def uses_qk_norm(self) -> bool:
        return self.model_type == "gemma3_text"

    @property
    def attention_softcap(self) -> float | None:
        # Gemma 3 stores attn_logit_softcapping but never applies it (hf_nnx.md §1.2).
        return self.attn_logit_softcapping if self.model_type == "gemma2" else None

    def replace(self, **changes) -> "GemmaConfig":
        return dataclasses.replace(self, **changes)

    def num_parameters(self) -> int:
        d, f, n, k, h = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                         self.num_key_value_heads, self.head_dim)
        per_layer = d * (n * h) * 2 + d * (k * h) * 2 + 3 * d * f + 2 * d
        per_layer += 2 * d if self.uses_sandwich_norms else 0
        per_layer += 2 * h if self.uses_qk_norm else 0
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + head + d + self.num_hidden_layers * per_layer

    # ---------------------------------------------------------------------------------------------- HF I/O
    @classmethod
    def from_hf_dict(cls, data: dict[str, Any], *, where: str = "config.json") -> "GemmaConfig":
        """Read a transformers config dict. Missing keys take the transformers class defaults (FAMILY_DEFAULTS),
        as transformers itself does: the multimodal Gemma 3 configs on the Hub list only what differs from
        them (gemma-3-4b's `text_config` has no `vocab_size`, `num_attention_heads` or `head_dim`)."""
        data = copy.deepcopy(data)
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a JSON object, found {type(data).__name__}.")
        model_type = data.get("model_type")
        if model_type == "gemma3":
            text = data.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{where}: a multimodal 'gemma3' config needs a text_config object.")
            text = dict(text)
            text["model_type"] = "gemma3_text"
            text.setdefault("tie_word_embeddings", data.get("tie_word_embeddings", True))
            data, model_type = text, "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"{where}: model_type {model_type!r} is not supported; expected one of "
                              f"{SUPPORTED_MODEL_TYPES} (or a multimodal 'gemma3' with a text_config).")
        given = {k: v for k, v in data.items() if v is not None or k not in _NULL_MEANS_DEFAULT}
        values = {**FAMILY_DEFAULTS[model_type], **given}
        number = _Numbers(values, where)
        hidden, heads = number.int("hidden_size"), number.int("num_attention_heads")
        num_layers = number.int("num_hidden_layers")
        kwargs = dict(
            model_type=model_type,
            vocab_size=number.int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=number.int("intermediate_size"),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=number.int("num_key_value_heads", heads),
            head_dim=number.int("head_dim", hidden // heads if heads > 0 else 0),
            rms_norm_eps=number.float("rms_norm_eps"),
            tie_word_embeddings=number.bool("tie_word_embeddings"),
            final_logit_softcapping=number.float("final_logit_softcapping", None),
        )
        if model_type != "gemma":
            kwargs["query_pre_attn_scalar"] = number.int_or_float("query_pre_attn_scalar")  # int in transformers 5
            kwargs["sliding_window"] = number.int("sliding_window", None)
        if model_type == "gemma2":
            kwargs["attn_logit_softcapping"] = number.float("attn_logit_softcapping", None)
        _check_activation(values, model_type, where)
        kwargs["layer_types"] = _layer_types(values, model_type, num_layers, where)
        kwargs["rope"] = _rope(values, model_type, where)
        if values.get("use_bidirectional_attention"):
            raise ConfigError(f"{where}: use_bidirectional_attention=True (embedding models) is not supported.")
        try:
            return cls(**kwargs, raw=data)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None

    def to_hf_dict(self, *, dtype: str | None = None) -> dict[str, Any]:
        """A config.json that transformers 5 and 4.5x both read the same way (hf_nnx.md §1.5)."""
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
        out.setdefault("hidden_activation", "gelu_pytorch_tanh")
        if self.model_type == "gemma":
            out["hidden_act"] = "gelu_pytorch_tanh"
        if self.model_type != "gemma":
            out["query_pre_attn_scalar"] = self.query_pre_attn_scalar
            out["sliding_window"] = self.sliding_window
            out["attn_logit_softcapping"] = self.attn_logit_softcapping
        full = self.rope[FULL]
        scaling = {"rope_type": "linear", "factor": full.linear_factor} if full.linear_factor != 1.0 else None
        if self.model_type == "gemma3_text":
            out["rope_parameters"] = {t: _rope_dict(self.rope[t]) for t in (SLIDING, FULL)}
            out["rope_local_base_freq"] = self.rope[SLIDING].theta
            pattern = _pattern_of(self.layer_types)
            if pattern:
                out["sliding_window_pattern"] = pattern
                out["_sliding_window_pattern"] = pattern
            else:
                out.pop("sliding_window_pattern", None)
                out.pop("_sliding_window_pattern", None)
        else:
            out["rope_parameters"] = _rope_dict(full)
        out["rope_theta"] = full.theta
        out["rope_scaling"] = scaling
        if dtype is not None:
            out["dtype"] = dtype
            out["torch_dtype"] = dtype
        return out

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "GemmaConfig":
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


class _Numbers:
    """Typed reads of config values: a ConfigError naming the key for a value of the wrong kind."""

    _MISSING = object()

    def __init__(self, values: dict, where: str):
        self.values, self.where = values, where

    def _get(self, key: str, default):
        value = self.values.get(key)
        if value is None:
            if default is self._MISSING:
                raise ConfigError(f"{self.where}: {key} is missing or null; it must be a number.")
            return default, True
        return value, False

    def int(self, key: str, default=_MISSING):
        value, defaulted = self._get(key, default)
        if defaulted:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value != int(value):
            raise ConfigError(f"{self.where}: {key}={value!r} is not an integer.")
        return int(value)

    def float(self, key: str, default=_MISSING):
        value, defaulted = self._get(key, default)
        if defaulted:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.where}: {key}={value!r} is not a finite number.")
        return float(value)

    def int_or_float(self, key: str):
        value = self.float(key)
        return int(value) if value == int(value) else value

    def bool(self, key: str):
        value, _ = self._get(key, self._MISSING)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}: {key}={value!r} must be true or false.")
        return value


def validate(cfg: GemmaConfig) -> None:
    where = f"{cfg.model_type} config"
    positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")
    for name in positive:
        if int(getattr(cfg, name)) <= 0:
            raise ConfigError(f"{where}: {name}={getattr(cfg, name)} must be a positive integer.")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{where}: num_attention_heads={cfg.num_attention_heads} is not a multiple of num_key_value_heads="
            f"{cfg.num_key_value_heads}; every KV head must serve the same number of query heads.")
    if cfg.model_type != "gemma" and cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(
            f"{where}: hidden_size={cfg.hidden_size} is not a multiple of num_attention_heads="
            f"{cfg.num_attention_heads}; transformers rejects such Gemma 2/3 configs although head_dim is explicit.")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ConfigError(f"{where}: layer_types has {len(cfg.layer_types)} entries for "
                          f"num_hidden_layers={cfg.num_hidden_layers}.")
    unknown = set(cfg.layer_types) - {FULL, SLIDING}
    if unknown:
        raise ConfigError(f"{where}: unknown layer_types {sorted(unknown)}; expected {FULL!r} or {SLIDING!r}.")
    needed = {FULL} | set(cfg.layer_types) | ({SLIDING} if cfg.model_type == "gemma3_text" else set())
    if needed - set(cfg.rope):
        raise ConfigError(f"{where}: rope has no entry for {sorted(needed - set(cfg.rope))}; give a RopeSpec "
                          "per attention type.")
    if SLIDING in cfg.layer_types and not cfg.sliding_window:
        raise ConfigError(f"{where}: sliding layers need a positive sliding_window.")


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _check_activation(values: dict, model_type: str, where: str) -> None:
    key = "hidden_act" if model_type == "gemma" else "hidden_activation"
    act = values.get(key) or "gelu_pytorch_tanh"
    allowed = TANH_GELU | ({"gelu"} if model_type == "gemma" else set())
    if not isinstance(act, str) or act not in allowed:
        raise ConfigError(f"{where}: {key}={act!r} is not supported; Gemma uses the tanh GELU "
                          f"('gelu_pytorch_tanh').")


def _layer_types(data: dict, model_type: str, num_layers: int, where: str) -> tuple[str, ...]:
    given = data.get("layer_types")
    if given is not None:
        if not isinstance(given, (list, tuple)) or not all(isinstance(kind, str) for kind in given):
            raise ConfigError(f"{where}: layer_types must be a list of attention type names, got {given!r:.80}.")
        if len(given) != num_layers:
            raise ConfigError(f"{where}: layer_types has {len(given)} entries but num_hidden_layers is {num_layers}; "
                              "after removing layers keep exactly the surviving layers' entries.")
        return tuple(given)
    if model_type == "gemma":
        return (FULL,) * num_layers
    if model_type == "gemma2":
        return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    pattern = data.get("sliding_window_pattern") or data.get("_sliding_window_pattern") or 6
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"{where}: sliding_window_pattern={pattern!r} must be a positive integer.")
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def _rope(data: dict, model_type: str, where: str) -> dict[str, RopeSpec]:
    params = data.get("rope_parameters")

    def spec(entry: dict | None, default_theta: float) -> RopeSpec:
        entry = entry or {}
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: a RoPE entry must be an object with rope_type / rope_theta, got "
                              f"{entry!r:.80}.")
        kind = entry.get("rope_type", entry.get("type", "default"))
        if kind not in ("default", "linear"):
            raise ConfigError(f"{where}: rope_type {kind!r} is not supported (only 'default' and 'linear').")
        number = _Numbers(entry, f"{where} RoPE")
        factor = number.float("factor", 1.0) if kind == "linear" else 1.0
        return RopeSpec(number.float("rope_theta", default_theta), factor)

    if model_type == "gemma3_text":
        if isinstance(params, dict) and (FULL in params or SLIDING in params):
            return {FULL: spec(params.get(FULL), 1_000_000.0), SLIDING: spec(params.get(SLIDING), 10_000.0)}
        number = _Numbers(data, where)
        full = spec(data.get("rope_scaling"), 1_000_000.0)
        full = RopeSpec(number.float("rope_theta", 1_000_000.0), full.linear_factor)
        return {FULL: full, SLIDING: RopeSpec(number.float("rope_local_base_freq", 10_000.0))}
    if isinstance(params, dict) and "rope_theta" in params:
        one = spec(params, 10_000.0)
    else:
        one = spec(data.get("rope_scaling"), 10_000.0)
        one = RopeSpec(_Numbers(data, where).float("rope_theta", 10_000.0), one.linear_factor)
    return {FULL: one, SLIDING: one}


def _rope_dict(spec: RopeSpec) -> dict[str, Any]:
    if spec.linear_factor != 1.0:
        return {"rope_type": "linear", "factor": spec.linear_factor, "rope_theta": spec.theta}
    return {"rope_type": "default", "rope_theta": spec.theta}


def _pattern_of(layer_types: tuple[str, ...]) -> int | None:
    """The `sliding_window_pattern` that regenerates `layer_types`, or None when no regular pattern does."""
    for pattern in range(1, len(layer_types) + 2):
        if tuple(SLIDING if (i + 1) % pattern else FULL for i in range(len(layer_types))) == layer_types:
            return pattern
    return None

