"""Typed reads of config.json values and RoPE settings, shared by every family's config adapter."""
from __future__ import annotations

import dataclasses
import math
from typing import Any

FULL, SLIDING = "full_attention", "sliding_attention"
ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(ValueError):
    """A config.json that cannot describe a model this toolkit can run."""


@dataclasses.dataclass(frozen=True)
class Rope:
    """RoPE for one attention type, as transformers' `rope_parameters` describe it.

    `kind` "default": inverse frequencies theta^(-2i/H); "linear": divided by `factor`; "llama3": Llama 3.1's
    wavelength-dependent scaling (`factor`, `low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`)."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_TYPES:
            raise ConfigError(f"Rope kind {self.kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}).")
        if self.kind == "linear" and self.factor == 1.0:  # the same RoPE as the default: one spelling of it
            object.__setattr__(self, "kind", "default")

    @property
    def linear_factor(self) -> float:
        return self.factor if self.kind == "linear" else 1.0

    def to_hf(self) -> dict[str, Any]:
        if self.kind == "linear" and self.factor != 1.0:
            return {"rope_type": "linear", "factor": self.factor, "rope_theta": self.theta}
        if self.kind == "llama3":
            return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                    "high_freq_factor": self.high_freq_factor,
                    "original_max_position_embeddings": self.original_max_position_embeddings,
                    "rope_theta": self.theta}
        return {"rope_type": "default", "rope_theta": self.theta}


class Numbers:
    """Typed reads of config values: a ConfigError naming the key for a value of the wrong kind."""

    MISSING = object()

    def __init__(self, values: dict, where: str):
        self.values, self.where = values, where

    def _get(self, key: str, default):
        value = self.values.get(key)
        if value is None:
            if default is self.MISSING:
                raise ConfigError(f"{self.where}: {key} is missing or null; it must be a number.")
            return default, True
        return value, False

    def int(self, key: str, default=MISSING):
        value, defaulted = self._get(key, default)
        if defaulted:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value != int(value):
            raise ConfigError(f"{self.where}: {key}={value!r} is not an integer.")
        return int(value)

    def float(self, key: str, default=MISSING):
        value, defaulted = self._get(key, default)
        if defaulted:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.where}: {key}={value!r} is not a finite number.")
        return float(value)

    def int_or_float(self, key: str):
        value = self.float(key)
        return int(value) if value == int(value) else value

    def bool(self, key: str, default=MISSING):
        value, defaulted = self._get(key, default)
        if defaulted:
            return value
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}: {key}={value!r} must be true or false.")
        return value


def rope_entry(entry: Any, default_theta: float, where: str) -> Rope:
    """One `rope_parameters` (or legacy `rope_scaling`) object -> Rope; unsupported kinds are a ConfigError."""
    entry = entry or {}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: a RoPE entry must be an object with rope_type / rope_theta, got {entry!r:.80}.")
    kind = entry.get("rope_type", entry.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)}).")
    number = Numbers(entry, f"{where} RoPE")
    theta = number.float("rope_theta", default_theta)
    if kind == "default":
        return Rope(theta)
    if kind == "linear":
        return Rope(theta, "linear", number.float("factor", 1.0))
    return Rope(theta, "llama3", number.float("factor"), number.float("low_freq_factor"),
                number.float("high_freq_factor"), number.int("original_max_position_embeddings"))


def legacy_rope(data: dict, default_theta: float, where: str) -> Rope:
    """RoPE from `rope_parameters` with a rope_theta, else from the legacy `rope_theta` + `rope_scaling` keys."""
    params = data.get("rope_parameters")
    if isinstance(params, dict) and ("rope_theta" in params or "rope_type" in params):
        theta = Numbers(data, where).float("rope_theta", default_theta)
        return rope_entry(params, theta, where)
    scaling = data.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}: a RoPE entry (rope_scaling) must be an object with rope_type / rope_theta, "
                          f"got {scaling!r:.80}.")
    scaling = dict(scaling)
    scaling["rope_theta"] = Numbers(data, where).float("rope_theta", default_theta)
    return rope_entry(scaling, default_theta, where)


def pattern_of(layer_types: tuple[str, ...]) -> int | None:
    """The `sliding_window_pattern` that regenerates `layer_types`, or None when no regular pattern does."""
    for pattern in range(1, len(layer_types) + 2):
        if tuple(SLIDING if (i + 1) % pattern else FULL for i in range(len(layer_types))) == layer_types:
            return pattern
    return None


def layer_types_given(data: dict, num_layers: int, where: str) -> tuple[str, ...] | None:
    given = data.get("layer_types")
    if given is None:
        return None
    if not isinstance(given, (list, tuple)) or not all(isinstance(kind, str) for kind in given):
        raise ConfigError(f"{where}: layer_types must be a list of attention type names, got {given!r:.80}.")
    if len(given) != num_layers:
        raise ConfigError(f"{where}: layer_types has {len(given)} entries but num_hidden_layers is {num_layers}; "
                          "after removing layers keep exactly the surviving layers' entries.")
    return tuple(given)
