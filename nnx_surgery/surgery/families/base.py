"""What a model family is: its tensor schema plus a config adapter (see nnx_surgery/surgery/families/gemma.py, llama.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


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
    `gguf_architectures`: llama.cpp architecture name -> model_type, for the families the GGUF importer reads."""

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
    gguf_architectures: dict[str, str] = dataclasses.field(default_factory=dict)
