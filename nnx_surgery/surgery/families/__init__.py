"""The model families the toolkit knows: each a tensor schema plus a config adapter, found by `model_type`.

Adding a family: a module with a `FAMILY = Family(...)` (its tensors, config defaults, read/write of its
config.json keys), registered in FAMILIES below. The model, loading, saving, surgery and GGUF import read it."""
from __future__ import annotations

from .base import Family
from .gemma import FAMILY as GEMMA
from .llama import FAMILY as LLAMA

FAMILIES: tuple[Family, ...] = (GEMMA, LLAMA)
BY_MODEL_TYPE: dict[str, Family] = {t: family for family in FAMILIES for t in family.architectures}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(BY_MODEL_TYPE)
ARCHITECTURES: dict[str, str] = {t: arch for family in FAMILIES for t, arch in family.architectures.items()}

__all__ = ["Family", "FAMILIES", "BY_MODEL_TYPE", "SUPPORTED_MODEL_TYPES", "ARCHITECTURES", "GEMMA", "LLAMA"]
