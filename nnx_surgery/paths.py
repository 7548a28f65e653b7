"""The checks that turn a missing or unusable path into one line naming the argument, for every command, the
recipes and the evaluation alike: a model folder and its files (model_folder, check_folder_files), an output
that must not overwrite an input (input_paths, guard_output, guard_folder, writable_place), a new file or an
empty folder (new_file, empty_folder), and files staged beside their folder until the command succeeds
(staged_files)."""
from __future__ import annotations

import contextlib
import glob
import functools
import json
import os
import shutil
import stat
import tempfile
from typing import Iterator, Sequence

from nnx_surgery.refusals import REFUSED_PATHS, RecipeError, wrong_kind
from nnx_surgery.surgery.storage.atomic import NAME_MAX, clean_leftovers, temp_prefix


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


def input_paths(*given: str | None) -> list[str]:
    """The local paths among a command's inputs (a Hub id, hf:NAME or gguf:NAME is none; a glob gives its
    matches), for `guard_output`."""


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
        clean_leftovers(ancestor, os.path.basename(out))
    tmp = tempfile.mkdtemp(prefix=temp_prefix(os.path.basename(out), "partial"), dir=ancestor)
    try:
        yield tmp
        os.makedirs(out, exist_ok=True)
        for name in sorted(os.listdir(tmp)):
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


__all__ = ["model_folder", "check_folder_files", "input_paths", "guard_output", "writable_place", "guard_folder",
           "empty_folder", "new_file", "staged_files"]
