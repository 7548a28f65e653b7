"""What the subcommands of `nnx-surgery` run (the parser is nnx_surgery/cli.py), one module per group:

    surgery_steps   plan, prune
    training        distill, eval
    teacher_cache   cache-teacher
    models          generate, import-gguf, export-gguf, push

Each function takes the parsed flags and calls the Python API; what they share is here (the recipe's data
pipeline, a model's plan and shape); the checks that turn a missing or unusable path into one line naming the
argument are nnx_surgery/paths.py, shared with the recipes and the evaluation.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import stat
import tempfile
from typing import Callable, Iterator, Sequence

from nnx_surgery import model_inputs, surgery
from nnx_surgery.recipes.inputs import corpus, tiny_teacher
from nnx_surgery.refusals import RecipeError


PLAN_FILE = "plan.json"


def plan_of(folder: str) -> "surgery.Plan | None":
    """The surgery plan saved with a model folder (plan.json), None when it has none."""

    path = os.path.join(folder, PLAN_FILE)
    return surgery.Plan.load(path) if os.path.isfile(path) else None


def kept_vocab(folder: str, name: str, teacher: "surgery.ModelConfig") -> tuple[int, ...] | None:
    """The teacher ids of a trimmed student's pieces (its plan.json), None when it has the teacher's vocabulary;
    a RecipeError for a vocabulary the teacher's cannot be mapped to."""

    config, plan = surgery.ModelConfig.from_file(folder), plan_of(folder)
    if plan is not None and plan.kept_vocab is not None:
        plan.check_teacher(teacher, where=f"--teacher (for {name} {folder})")
        return tuple(plan.kept_vocab)
    if config.vocab_size != teacher.vocab_size:
        raise RecipeError(f"{name} {folder}: its vocabulary ({config.vocab_size:,}) is not the teacher's "
                          f"({teacher.vocab_size:,}) and it has no plan.json with the kept pieces; give the "
                          "teacher it was cut from.")
    return None


def resolve_flag_value(flag: str, value, resolve: Callable):
    """`resolve(value)`, its ValueError turned into a RecipeError naming the flag."""
    try:
        return resolve(value)
    except ValueError as error:
        raise RecipeError(f"{flag} {value!r}: {error}") from None


def text_batches(args: argparse.Namespace, teacher_folder: str, *, tokenizer: str | None = None,
                 batch_size: int = 1):
    """(batches, description) of `--data` (or, without it, `--corpus-bytes` of the standard library's source) in
    the tokens of `tokenizer` (default: the teacher's): the recipe's own pipeline (corpus.load_data: packed
    rows, BOS at the start of rows that continue a document, the teacher's position limit, a held-out split)."""

    corpus_files = None if args.data else tuple(tiny_teacher.corpus_files(args.corpus_bytes, args.seed))
    description = args.data if corpus_files is None else \
        f"{len(corpus_files)} modules of the Python standard library's source"
    settings = corpus.DataSettings(files=args.data, corpus=corpus_files, description=description,
                                   teacher_folder=teacher_folder, batch_size=batch_size, seq_len=args.seq_len,
                                   seed=args.seed, position_limit=model_inputs.position_limit(teacher_folder))
    return corpus.load_data(settings, tokenizer), description  # its refusals name the flags


def shape_line(config) -> str:
    """A model's shape in one line."""
    return (f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, MLP {config.intermediate_size}, "
            f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV, vocabulary {config.vocab_size:,}, "
            f"{config.num_parameters() / 1e6:,.2f}M parameters")


__all__ = ["teacher_source", "model_folder", "check_folder_files", "writable_place", "input_paths", "guard_output",
           "guard_folder", "empty_folder", "new_file",
           "staged_files", "resolve_flag_value", "text_batches", "shape_line", "plan_of", "kept_vocab", "PLAN_FILE"]
