"""What a model family is: its tensor schema, its config adapter, its divisibility rules and, where llama.cpp's
files for it are built, its GGUF metadata conversion (see nnx_surgery/surgery/families/gemma.py, llama.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from nnx_surgery.surgery.families.errors import CheckpointError

# The divisibility rule a family may impose beyond the universal one (query heads a multiple of the KV heads).
HIDDEN_MULTIPLE_OF_HEADS = "hidden_size must be a multiple of num_attention_heads"


class GGUFKeys:
    """A GGUF file's metadata as a family reads it: `keys(name)` is `<arch>.<name>`, a CheckpointError naming
    the file when it is missing and no default is given; `keys.raw` is the whole metadata dict."""

    def __init__(self, metadata: dict[str, Any], arch: str, where: str):
        self.raw, self.arch, self.where = metadata, arch, where

    def __call__(self, name: str, default: Any = KeyError) -> Any:
        value = self.raw.get(f"{self.arch}.{name}", default)
        if value is KeyError:
            raise CheckpointError(f"{self.where}: metadata key {self.arch}.{name} is missing; the file is incomplete.")
        return value


@dataclasses.dataclass(frozen=True)
class GGUFFormat:
    """How a family's configs meet llama.cpp's GGUF files, both ways. The sizes, head counts, head_dim, RMS
    epsilon, context length, RoPE base and linear scaling, tying and special-token ids are llama.cpp's common keys
    (gguf_import.py, gguf_export.py); the rest is the family's:

    `architectures`: llama.cpp architecture -> model_type. `read(model_type, keys, config)`: the family's keys of
    the transformers config dict the file describes (`config` holds the common ones already; `keys` a GGUFKeys).
    `check(config, where)`: a CheckpointError for what llama.cpp's graph for the model type cannot run.
    `write(writer, config)`: the family's `<arch>.*` keys (a gguf.GGUFWriter). `query_scale(config)`: what the
    queries are multiplied by so that llama.cpp's fixed attention scale gives the model's. `context_lengths`:
    model_type -> transformers' default max_position_embeddings (llama.cpp requires one)."""

    architectures: dict[str, str]
    read: Callable[[str, GGUFKeys, dict[str, Any]], dict[str, Any]]
    check: Callable[[Any, str], None]
    write: Callable[[Any, Any], None]
    query_scale: Callable[[Any], float]
    context_lengths: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Family:
    """A family of HF model types sharing one tensor schema.

    `architectures`: model_type -> the transformers class name written into config.json. `defaults`: model_type ->
    the transformers config-class defaults for keys a config.json leaves out. `normalise(data, where)` rewrites a
    config dict into one of `architectures`' model types (e.g. a multimodal wrapper); `read(values, model_type,
    numbers, where)` returns the family-specific ModelConfig fields; `write(config, out)` adds the family's keys to
    a config.json dict; `validate(config, where)` raises ConfigError for what transformers would reject.
    `norm_offset`: RMSNorm weights act as (1 + w) (else w); `scales_embeddings`: embeddings are multiplied by
    sqrt(hidden_size). The frozensets name the model types with sandwich norms, q/k norms and attention soft-caps.
    `hidden_multiple_of_heads`: the model types whose transformers config rejects a hidden_size that is not a
    multiple of num_attention_heads even with head_dim explicit (checked by `ModelConfig` and `StudentSpec`).
    `gguf`: the GGUF conversion (import and export), or None with `no_gguf` saying why there is none."""

    name: str
    architectures: dict[str, str]
    tensors: tuple
    defaults: dict[str, dict[str, Any]]
    normalise: Callable[[dict, str], dict]
    read: Callable[..., dict[str, Any]]
    write: Callable[[Any, dict[str, Any]], None]
    validate: Callable[[Any, str], None]
    attention_scale: Callable[[Any], float]
    norm_offset: bool
    scales_embeddings: bool
    sandwich_norms: frozenset = frozenset()
    qk_norm: frozenset = frozenset()
    attention_softcap: frozenset = frozenset()
    hidden_multiple_of_heads: frozenset = frozenset()
    gguf: GGUFFormat | None = None
    no_gguf: str = ""

    def __post_init__(self):
        if (self.gguf is None) == (not self.no_gguf):
            raise ValueError(f"family {self.name!r}: give either a GGUF conversion or, in no_gguf, why there is none.")

    def gguf_format(self) -> GGUFFormat:
        """The family's GGUF conversion; a ValueError saying why there is none (`no_gguf`) otherwise."""
        if self.gguf is None:
            raise ValueError(f"family {self.name!r} has no GGUF conversion: {self.no_gguf}")
        return self.gguf

    def broken_rule(self, model_type: str, hidden_size: int, num_attention_heads: int) -> str | None:
        """The divisibility rule that (hidden_size, num_attention_heads) breaks for `model_type`, or None."""
        if model_type in self.hidden_multiple_of_heads and hidden_size % num_attention_heads:
            return HIDDEN_MULTIPLE_OF_HEADS
        return None
