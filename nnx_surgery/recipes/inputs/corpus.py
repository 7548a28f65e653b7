"""The recipe's training text: what it reads (`DataSettings`, part of the run's resolved settings) and the batches
made of it (`load_data`), in the teacher's tokens or a trimmed student's."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

import jax

from nnx_surgery import distill
from nnx_surgery import refusals
from nnx_surgery.distill.inputs import packaged_prose, sources
from nnx_surgery.recipes.config.sections import GENERAL_SOURCES


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """Where the text comes from and how it is batched: `files` is --data (files, a folder, a glob or hf:NAME),
    `corpus` a preset's corpus files (then --data is not read), `description` what the model card and the
    held-out set say of it; `position_limit` is TokenBatches' `max_positions` from the teacher's config."""

    files: str | None
    corpus: tuple[str, ...] | None
    description: str
    teacher_folder: str
    batch_size: int
    seq_len: int
    seed: int
    restart_rows: bool = True
    general_mix: float = 0.0
    general_source: str = "pydoc"
    position_limit: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def load_data(settings: DataSettings, tokenizer: str | None = None) -> distill.TokenBatches:
    """The run's batches: the preset's corpus files when it has one, else --data, in the tokens of `tokenizer` (a
    folder; default: the teacher's). On multi-host each process tokenises its share and keeps its rows of every
    batch. The data pipeline's refusals name its Python arguments; here they read as the flags."""
    try:
        return _batches(settings, tokenizer or settings.teacher_folder)
    except distill.DataError as error:
        raise distill.DataError(re.sub(r"\b(seq_len|batch_size)\b", lambda m: "--" + m.group(1).replace("_", "-"),
                                       str(error))) from None


def _batches(settings: DataSettings, tokenizer: str) -> distill.TokenBatches:
    corpus, data = (list(settings.corpus) if settings.corpus is not None else None), settings.files or ""
    if corpus is None and not data:
        raise refusals.RecipeError("--data is required with this teacher (text files, a folder, a glob, or hf:NAME).")
    common = dict(batch_size=settings.batch_size, seq_len=settings.seq_len, seed=settings.seed,
                  eval_batch_size=settings.batch_size, process_index=jax.process_index(),
                  process_count=jax.process_count(), **settings.position_limit)
    text_tokenizer = distill.load_tokenizer(tokenizer)
    if settings.restart_rows and text_tokenizer.add_bos:  # a row continuing a document starts with BOS, as documents do
        common["restart_id"] = text_tokenizer.bos_id
    if settings.general_mix:  # general prose beside the domain corpus: training only, never held out
        if corpus is None and data.startswith("hf:"):
            raise refusals.RecipeError("--general-mix needs text files (--data FILES or a preset's corpus), not hf:; "
                                  "mix general text into the dataset itself instead.")
        files = corpus if corpus is not None else sources.expand_paths(data)
        parts = general_parts(settings, sum(os.path.getsize(f) for f in files))
        common["extra_train"] = [text for _, texts in parts for text in texts]
        common["extra_sources"] = [name for name, texts in parts for _ in texts]
    if corpus is not None:
        return distill.TokenBatches.from_files(corpus, tokenizer, **common)
    if data.startswith("hf:"):
        return distill.TokenBatches.from_hf_dataset(data[3:], tokenizer, **common)
    return distill.TokenBatches.from_files(data, tokenizer, **common)


def general_parts(settings: DataSettings, corpus_bytes: int) -> list[tuple[str, list[str]]]:
    """(source name, documents) of the general mix beside a corpus of `corpus_bytes` bytes (about --general-mix of
    the corpus plus it): the pydoc topics' train part repeated ("pydoc"), the `prose` extra's packaged prose
    ("packages"; nnx_surgery/distill/inputs/packaged_prose.py), or both ("pydoc+packages"), each sized as though
    beside half the corpus, so that each makes half the general share by bytes (the pydoc part in whole copies).
    Training text only, never held out: the pydoc part is the topics' train part, disjoint from the general
    held-out set."""
    source, share = settings.general_source, settings.general_mix
    if source == "pydoc":
        return [("pydoc topics", distill.general_mix(corpus_bytes, share))]
    if source == "packages":
        return packaged_prose.prose_mix(corpus_bytes, share, settings.seed)
    if source != "pydoc+packages":
        raise refusals.RecipeError(f"--general-source {source!r}: choose from {', '.join(GENERAL_SOURCES)}.")
    half = corpus_bytes // 2
    return [("pydoc topics", distill.general_mix(half, share)),
            *packaged_prose.prose_mix(corpus_bytes - half, share, settings.seed)]


__all__ = ["DataSettings", "load_data", "general_parts", "GENERAL_SOURCES"]
