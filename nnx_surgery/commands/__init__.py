"""What the subcommands of `nnx-surgery` run (the parser is nnx_surgery/cli.py), one module per group:

    surgery_steps   plan, prune
    training        distill, eval
    teacher_cache   cache-teacher
    models          generate, import-gguf, export-gguf, push

Each function takes the parsed flags and calls the Python API; what they share is here: the checks that turn a
missing or unusable path into one line naming the argument, and the recipe's data pipeline.
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

from nnx_surgery import export, surgery
from nnx_surgery.recipes import corpus, tiny_teacher
from nnx_surgery import model_inputs
from nnx_surgery.model_inputs import teacher_folder
from nnx_surgery.refusals import REFUSED_PATHS, RecipeError, wrong_kind
from nnx_surgery.surgery.storage.atomic import NAME_MAX, _clean_leftovers, temp_prefix


def model_folder(path: str, name: str) -> str:
    """`path` when it is a Hugging Face model folder whose config.json (and tokenizer.json, when there) can be
    read, else a RecipeError naming `name`, the file and what is wrong with it."""
    if not os.path.isdir(path):
        raise RecipeError(f"{name} {path}: {wrong_kind(path, 'folder')}; give a Hugging Face model folder "
                          "(config.json and safetensors, as prune, distill, compress and import-gguf write).")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise RecipeError(f"{name} {path}: no config.json there, so it is not a Hugging Face model folder.")
    check_folder_files(path, name)
    return os.path.abspath(path)


def check_folder_files(folder: str, name: str) -> None:
    """The model folder's config.json is a JSON object with sizes that make sense, and its tokenizer.json (when
    there) is one the tokenizers library reads; else one line naming the file and the fix."""
    path = os.path.join(folder, "config.json")
    values = _json_object(path, name)
    values = values.get("text_config", values) if isinstance(values.get("text_config"), dict) else values
    limit = values.get("max_position_embeddings")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RecipeError(f"{name} {folder}: max_position_embeddings {limit!r} in {path} is no number of positions; "
                          "give a whole number above 0 there.")
    tokenizer = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tokenizer):
        if os.path.getsize(tokenizer) == 0:
            raise RecipeError(f"{name}: {tokenizer} is empty; copy the file again from the model it came with.")
        info = os.stat(tokenizer)
        why = _tokenizer_refused(tokenizer, info.st_mtime_ns, info.st_size)
        if why:
            raise RecipeError(f"{name} {folder}: {tokenizer} is not a tokenizer the tokenizers library reads ({why}); "
                              "copy it again from the model it came with.")


@functools.lru_cache(maxsize=16)
def _tokenizer_refused(path: str, mtime_ns: int, size: int) -> str | None:
    """Why the tokenizers library cannot read the tokenizer.json at `path` (None: it can), once per version of
    the file (a real Gemma's takes about a second)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        Tokenizer.from_file(path)
    except Exception as error:  # the library's own error type: not JSON, or a schema it cannot read
        return " ".join(str(error).split())
    return None


def _json_object(path: str, name: str) -> dict:
    """The JSON object in `path`, else a RecipeError saying what is wrong with the file."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except UnicodeDecodeError:
        raise RecipeError(f"{name}: {path} is not UTF-8 text, so not JSON; copy the file again.") from None
    except json.JSONDecodeError as error:
        what = "is empty" if not error.doc.strip() else f"is not valid JSON ({error.msg} at line {error.lineno} " \
            f"column {error.colno})"
        raise RecipeError(f"{name}: {path} {what}; copy the file again from the model it came with.") from None
    if not isinstance(values, dict):
        raise RecipeError(f"{name}: {path} holds a JSON {type(values).__name__}, not an object of settings; copy "
                          "the file again from the model it came with.")
    return values


def teacher_source(text: str, name: str, revision: str | None = None) -> str:
    """`recipes.model_inputs.teacher_folder` (a folder, a .gguf file, gguf:gemma3-270m or a Hub id), with a missing local
    path refused here, before it could be taken for a Hub id, and one that could be either named as both."""
    path = os.path.expanduser(text)
    local = path.startswith((".", os.sep)) or path.count("/") > 1
    if os.path.lexists(path) and not text.endswith(".gguf") and not os.path.isdir(path):
        raise RecipeError(f"{name} {text}: {wrong_kind(path, 'folder')}; give a model folder, a .gguf file, "
                          "gguf:gemma3-270m or a Hub id (user/name).")
    if text.endswith(".gguf") and os.path.lexists(path) and not os.path.isfile(path):
        raise RecipeError(f"{name} {text}: {wrong_kind(path, 'file')}; give a .gguf file.")
    if local and not text.endswith(".gguf") and not os.path.exists(path):
        raise RecipeError(f"{name} {text}: no such folder; give a model folder, a .gguf file, gguf:gemma3-270m "
                          "or a Hub id (user/name).")
    try:
        folder = teacher_folder(text, revision)
    except RecipeError as error:  # it names --teacher, the recipe's flag
        raise RecipeError(str(error).replace("--teacher", name, 1)) from None
    except (surgery.CheckpointError, export.HubError) as error:
        if os.path.exists(path) or text.endswith(".gguf"):
            raise
        raise RecipeError(f"{name} {text}: no such local folder, and not found on the Hub ({error}); check the "
                          "path, or give a Hub id (user/name).") from None
    return folder


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


def input_paths(*given: str | None) -> list[str]:
    """The local paths among a command's inputs (a Hub id, hf:NAME or gguf:NAME is none; a glob gives its
    matches), for `guard_output`."""
    import glob

    paths = []
    for text in given:
        if isinstance(text, (list, tuple)):
            paths += input_paths(*text)
            continue
        if not isinstance(text, str) or not text or text.startswith(("hf:", "gguf:")):
            continue
        path = os.path.expanduser(text)
        paths += [path] if os.path.lexists(path) else glob.glob(path)
    return paths


def guard_output(path: str, name: str, inputs: list[str], *, probe: bool = True) -> str:
    """Refuse an output that is, contains or lies inside one of `inputs` (symlinks resolved), that exists and is
    neither a regular file nor a folder, or that is itself a symbolic link (writing would replace the link, or
    write where it points): --overwrite replaces what it is given, so it must never be given an input or a
    device. Also what the file system would refuse only once the work is done (`writable_place`). Returns the
    output's absolute path."""
    if not path.strip():
        raise RecipeError(f"{name} {path!r}: an empty path (it would mean the current folder); give the path to "
                          "write.")
    real = os.path.realpath(path)
    for given in inputs:
        source = os.path.realpath(given)
        if real == source:
            how = "is"
        elif os.path.commonpath([real, source]) == source:
            how = "lies inside"
        elif os.path.commonpath([real, source]) == real:
            how = "contains"
        else:
            continue
        raise RecipeError(f"{name} {path}: {how} the input {given}, which this command reads; choose an output "
                          "path outside every input.")
    if os.path.islink(path):
        target = os.readlink(path)
        state = "" if os.path.exists(path) else ", which leads nowhere: dangling, or a loop"
        raise RecipeError(f"{name} {path}: is a symbolic link (to {target}{state}); an output is written only where "
                          "you point, so give the path itself (not a link to it), or remove the link.")
    if os.path.exists(path):
        mode = os.stat(path).st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise RecipeError(f"{name} {path}: is not a regular file or folder (a device, pipe or socket); give "
                              "the path of a file or folder to write.")
    writable_place(path, name, probe=probe)
    return os.path.abspath(path)


def writable_place(path: str, name: str, *, probe: bool = True) -> str:
    """What the file system would refuse only at the end, refused now: a name longer than it allows, a path
    through a file, and (`probe`: a temporary folder made and removed where the output's temporaries go) a
    read-only file system, a folder without write permission or a full disk. Returns that folder."""
    out = os.path.abspath(path)
    limit = NAME_MAX
    for part in out.split(os.sep):
        if len(os.fsencode(part)) > limit:
            raise RecipeError(f"{name} {path}: the name {part[:40]}... is {len(os.fsencode(part))} bytes; the file "
                              f"system allows {limit}; choose a shorter name.")
    place = os.path.dirname(out)
    while not os.path.lexists(place):
        place = os.path.dirname(place)
    if not os.path.isdir(place):
        raise RecipeError(f"{name} {path}: {place} {wrong_kind(place, 'folder')}; an output goes in a folder: "
                          "choose another path.")
    if probe:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".nnx-surgery-probe-", dir=place))
        except OSError as error:
            why = REFUSED_PATHS.get(error.errno or 0, "choose a folder you may write")
            raise RecipeError(f"{name} {path}: cannot write in {place} ({error.strerror}); {why}.") from None
    return place


def guard_folder(path: str, name: str, inputs: list[str], *, probe: bool = True) -> str:
    """`guard_output` for an output folder, also refusing the file system's root, the home folder and any folder
    holding the current one: what --overwrite would delete is never where the user stands."""
    out = guard_output(path, name, inputs, probe=probe)
    real = os.path.realpath(path)
    if real in (os.path.realpath(os.sep), os.path.realpath(os.path.expanduser("~"))) or \
            os.path.commonpath([real, os.path.realpath(os.getcwd())]) == real:
        raise RecipeError(f"{name} {path}: is the root, the home folder or holds the current folder; give a "
                          "folder of its own, e.g. runs/NAME.")
    return out


def empty_folder(path: str, name: str, overwrite: bool, inputs: Sequence[str] = ()) -> str:
    """A folder to write into: absent or empty, or anything with `overwrite`; never an existing file, an input
    of the command or a folder holding one, nor the current folder or one above it (`guard_folder`)."""
    guard_folder(path, name, list(inputs))
    if os.path.exists(path) and not os.path.isdir(path):
        raise RecipeError(f"{name} {path}: exists and is not a folder; choose another path.")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise RecipeError(f"{name} {path}: the folder is not empty; pass --overwrite to replace it, or choose "
                          "another path.")
    return os.path.abspath(path)


def new_file(path: str, name: str, overwrite: bool, *, inside: str | None = None,
             inputs: Sequence[str] = ()) -> str:
    """A file to write (a folder gets `inside` appended): refused when it exists unless `overwrite`, and when
    `guard_output` refuses it. Its folder is not created here: the writer makes it once everything is checked."""
    if inside is not None and os.path.isdir(path):
        path = os.path.join(path, inside)
    guard_output(path, name, list(inputs))
    if os.path.isdir(path):
        raise RecipeError(f"{name} {path}: is a folder; give a file path.")
    if os.path.exists(path) and not overwrite:
        raise RecipeError(f"{name} {path}: exists; pass --overwrite to replace it, or choose another path.")
    return os.path.abspath(path)


@contextlib.contextmanager
def staged_files(out: str) -> Iterator[str]:
    """A temporary folder for the files a command writes into the folder `out`, beside it: moved into `out` (made
    only then) one rename each when the block succeeds, removed when not, so that a failure (a full disk, Ctrl-C)
    leaves `out` and its parents as they were. Files already in `out` that the command does not write are kept."""
    out = os.path.abspath(out)
    ancestor = os.path.dirname(out)
    while not os.path.isdir(ancestor):
        ancestor = os.path.dirname(ancestor)

    if ancestor == os.path.dirname(out):  # a killed run's staging folder is its writer's, named as atomic_folder's
        _clean_leftovers(ancestor, os.path.basename(out))
    tmp = tempfile.mkdtemp(prefix=temp_prefix(os.path.basename(out), "partial"), dir=ancestor)
    try:
        yield tmp
        os.makedirs(out, exist_ok=True)
        for name in sorted(os.listdir(tmp)):
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def checked(flag: str, value, resolve: Callable):
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
           "staged_files", "checked", "text_batches", "shape_line", "plan_of", "kept_vocab", "PLAN_FILE"]
