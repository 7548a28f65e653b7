"""The model families the toolkit knows, found by `model_type` (and, for GGUF files, by llama.cpp architecture).

Adding a family: a module with a `FAMILY = Family(...)` (its tensors; its config defaults and the read/write of
its config.json keys; its divisibility rule; its GGUF conversion, or why it has none), registered in FAMILIES
below. The model, loading, saving, surgery, the spec and search checks and GGUF import and export read it."""
from __future__ import annotations

from .base import HIDDEN_MULTIPLE_OF_HEADS, Family, GGUFFormat, GGUFKeys
from .gemma import FAMILY as GEMMA
from .llama import FAMILY as LLAMA

FAMILIES: tuple[Family, ...] = (GEMMA, LLAMA)
BY_MODEL_TYPE: dict[str, Family] = {t: family for family in FAMILIES for t in family.architectures}
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(BY_MODEL_TYPE)
ARCHITECTURES: dict[str, str] = {t: arch for family in FAMILIES for t, arch in family.architectures.items()}
# llama.cpp architecture -> (family, HF model_type), for the families with a GGUF conversion.
BY_GGUF_ARCHITECTURE: dict[str, tuple[Family, str]] = {
    arch: (family, model_type) for family in FAMILIES if family.gguf
    for arch, model_type in family.gguf.architectures.items()}


def without_gguf() -> str:
    """The families with no GGUF conversion and why, for an error message ('' when every family has one)."""
    return "; ".join(f"the {f.name} family ({', '.join(f.architectures)}) has no GGUF conversion: {f.no_gguf}"
                     for f in FAMILIES if f.gguf is None)


__all__ = ["Family", "GGUFFormat", "GGUFKeys", "HIDDEN_MULTIPLE_OF_HEADS", "FAMILIES", "BY_MODEL_TYPE",
           "SUPPORTED_MODEL_TYPES", "ARCHITECTURES", "BY_GGUF_ARCHITECTURE", "without_gguf", "GEMMA", "LLAMA"]
