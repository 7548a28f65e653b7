"""`nnx-surgery cache-teacher`: the teacher's top-k distribution over the packed training rows, written once
(distill.inputs.topk_cache) so that later runs can train without the teacher in memory."""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from typing import Iterator

import jax

from nnx_surgery import distill, surgery
from nnx_surgery.commands import kept_vocab, text_batches
from nnx_surgery.model_inputs import teacher_source
from nnx_surgery.paths import empty_folder, input_paths, model_folder
from nnx_surgery.distill.inputs import topk_cache as teacher_cache
from nnx_surgery import refusals
from nnx_surgery.surgery.storage.atomic import atomic_folder, missing_folders


def _data_files(args: argparse.Namespace) -> dict[str, str] | str:
    """The local data files and their sha256 (a Hub dataset: its name; the default corpus: its description)."""
    if not args.data:
        return f"standard library source, {args.corpus_bytes} bytes"
    if args.data.startswith("hf:"):
        return args.data
    return {os.path.abspath(path): teacher_cache.file_sha256(path)
            for path in distill.inputs.sources.expand_paths(args.data)}


def _output(args: argparse.Namespace, inputs: list[str]) -> str:
    """--output: empty, replaced with --overwrite, or a partial cache continued with --resume."""
    if args.resume and args.overwrite:
        raise refusals.RecipeError("--resume and --overwrite: give one; --resume continues the cache in --output, "
                              "--overwrite starts it again.")
    out = empty_folder(args.output, "--output", args.resume or args.overwrite, inputs=inputs)
    if args.resume and (not os.path.isdir(out) or not any(n.startswith("progress-p") for n in os.listdir(out))):
        raise refusals.RecipeError(f"--resume {args.output}: no partial teacher cache there (no progress-p*.json); "
                              "run without --resume to write one.")
    if args.overwrite and jax.process_count() > 1 and os.path.isdir(out) and os.listdir(out):
        raise refusals.RecipeError(f"--overwrite {args.output}: with {jax.process_count()} processes the cache cannot be "
                              "swapped in whole; remove the folder first or give another --output.")
    return out


@contextlib.contextmanager
def _writing_into(out: str, overwrite: bool) -> Iterator[str]:
    """The folder the cache is written into: `out` itself (new, or continued with --resume), or with --overwrite a
    fresh folder beside it that replaces `out` only once the cache is complete, so that a failure (a full disk,
    Ctrl-C) leaves the previous cache as it was."""
    if not (overwrite and os.path.isdir(out) and os.listdir(out)):
        yield out
        return
    with atomic_folder(out, overwrite=True) as fresh:
        yield fresh


@contextlib.contextmanager
def _kept_only_if_resumable(out: str, args: argparse.Namespace) -> Iterator[None]:
    """A run that fails or is stopped leaves what --resume continues (shards listed in a progress file), else
    nothing: the folders it made are removed (a shard written just before Ctrl-C, with no progress file yet, is
    no partial cache). Ctrl-C and SIGTERM then say which: rerun the same command, or with --resume."""
    made = [] if os.path.isdir(out) else missing_folders(out)
    try:
        yield
    except teacher_cache.CacheError as error:
        _undo(out, made, args)
        raise refusals.RecipeError(str(error)) from None
    except BaseException as error:
        resumable = _undo(out, made, args)
        if isinstance(error, KeyboardInterrupt):
            advice = (f"the shards written so far are kept in {args.output}: rerun the same command with --resume "
                      "to continue (without it, the folder is refused as not empty)." if resumable else
                      refusals.NOTHING_WRITTEN)
            raise refusals.Stopped(advice, sigterm=refusals.by_sigterm(error)) from None
        raise


def _undo(out: str, made: list[str], args: argparse.Namespace) -> bool:
    """After a failure: whether `out` holds a partial cache --resume continues; if not, what this run wrote there
    is removed (`made`: the folders it created) when the folder was new or empty before (not with --overwrite,
    whose new cache was never swapped in, nor --resume, whose earlier shards stay)."""
    if os.path.isdir(out) and any(name.startswith("progress-p") for name in os.listdir(out)):
        return True
    if args.overwrite or args.resume or not os.path.isdir(out):
        return False
    for name in os.listdir(out):
        path = os.path.join(out, name)
        with contextlib.suppress(OSError):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
    for folder in made:  # deepest first; only those still empty
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    return False


def cache_teacher(args: argparse.Namespace) -> dict:
    """Write the cache of TEACHER over the data's packed rows into --output (with --student-folder, in a trimmed student's
    tokens); print where and how big."""
    teacher_folder = teacher_source(args.teacher, "TEACHER")
    config = surgery.ModelConfig.from_file(teacher_folder)
    student_folder = model_folder(args.student_folder, "--student-folder") if args.student_folder else None
    kept = kept_vocab(student_folder, "--student-folder", config) if student_folder else None
    pieces = config.vocab_size if kept is None else len(kept)
    if args.top_k > pieces:
        whose = "the teacher's vocabulary" if kept is None else "the student's trimmed vocabulary"
        raise refusals.RecipeError(f"--top-k {args.top_k}: {whose} has {pieces:,} pieces; give at most that many.")
    out = _output(args, input_paths(args.teacher, teacher_folder, args.student_folder, args.data))
    settings = teacher_cache.CacheSettings(top_k=args.top_k, encoding=args.encoding,
                                           rows_per_shard=args.rows_per_shard, batch_rows=args.batch_size,
                                           selection=args.cache_selection, sample_seed=args.seed)
    # a trimmed student's own tokens (kept comes from the student's folder)
    tokenizer_folder = student_folder if kept is not None and student_folder else teacher_folder
    if kept is not None:
        distill.inputs.batches.check_vocabulary(tokenizer_folder, len(kept))
    data, description = text_batches(args, teacher_folder, tokenizer=tokenizer_folder, batch_size=args.batch_size)
    tokenizer = os.path.join(tokenizer_folder, "tokenizer.json")
    identity = {"teacher": teacher_cache.folder_identity(teacher_folder),
                "tokenizer_sha256": teacher_cache.file_sha256(tokenizer) if os.path.isfile(tokenizer) else None,
                "vocab_map_sha256": teacher_cache.vocab_map_sha256(kept),
                "data": _data_files(args), "precision": args.precision}
    teacher: surgery.CausalLM | distill.TeacherInStudentVocabulary = surgery.load_pretrained(
        teacher_folder, dtype="bfloat16" if args.precision == "bf16" else "float32")
    if kept is not None:  # the teacher seen in the student's ids: its logits at the kept pieces, renormalised
        teacher = distill.TeacherInStudentVocabulary(teacher, kept)
    mesh = distill.make_mesh(args.mesh) if args.mesh else None
    what = teacher_cache.slots_text(args.cache_selection, args.top_k)
    print(f"[cache-teacher] {what} of {pieces:,} ({args.encoding}) over {data.num_rows} rows "
          f"of {args.seq_len} tokens of {description}", flush=True)
    with _kept_only_if_resumable(out, args):
        with _writing_into(out, args.overwrite) as folder:
            manifest = teacher_cache.write_cache(teacher, data, folder, settings, identity=identity, mesh=mesh,
                                                 resume=args.resume)
    size = sum(entry["bytes"] for entry in manifest.get("shards", []))
    tokens = manifest.get("num_rows", data.num_rows) * args.seq_len
    print(f"teacher cache: {out} ({len(manifest.get('shards', []))} shards, {size:,} bytes, "
          f"{size / max(1, tokens):.1f} bytes per token)")
    return manifest
