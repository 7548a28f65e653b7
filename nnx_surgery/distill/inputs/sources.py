"""Where distillation text comes from: text files (a file, a folder, a glob; `.jsonl` lines are records), HF
`datasets` (the `datasets` extra), and the Python standard library's source as an offline corpus. A record is a
text, or a (prompt, completion) pair whose prompt is not trained on (`distill.inputs.batches` packs them).

A dataset is named as the recipe's `--data hf:SPEC` names it: SPEC is a Hub name, a folder written by
`save_to_disk`, a local data file or glob (.jsonl/.json, .parquet, .csv, .txt, .arrow) or a folder of such files,
optionally followed by options in URL query form, e.g.
`hf:data/qa.jsonl?prompt=question&completion=answer&split=train&max_records=5000` (options: `split`, `config`,
`text`, `prompt`, `completion`, `max_records`, `streaming`). Records use the `text` column; a dataset without one
that has `prompt` and `completion` columns (the prompt-completion layout of TRL and others) is read as pairs.
"""
from __future__ import annotations

import ast
import glob
import itertools
import json
import os
import re
import sysconfig
import zlib
from typing import Any, Iterable, Sequence
from urllib.parse import parse_qsl

import numpy as np

Record = str | tuple[str, str]  # text, or (prompt, completion)


class DataError(ValueError):
    """The data source, tokenizer or batch settings cannot work; the message says how to fix it."""



def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """A file, a folder (all files below it, sorted) or a glob pattern (`**` allowed), or a list of those."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[str] = []
    for item in (os.fspath(path) for path in items):
        if os.path.isdir(item):
            found = sorted(p for p in glob.glob(os.path.join(item, "**", "*"), recursive=True) if os.path.isfile(p))
        elif any(ch in item for ch in "*?["):
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
        else:
            found = [item] if os.path.isfile(item) else []
        if not found:
            raise DataError(f"no files at {item!r}; pass an existing file, folder or glob pattern.")
        files += found
    return files


def read_records(paths, *, separator: str | None = None, text_field: str = "text",
                 prompt_field: str | None = None, completion_field: str | None = None) -> list[Record]:
    """Documents from text files: one per file, or split on `separator`; a `.jsonl` line is one record."""
    records: list[Record] = []
    files = expand_paths(paths)
    named = {os.fspath(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)}
    for path in files:
        text = read_text(path)
        if not text.strip() and path in named:
            raise DataError(f"{path} is empty; pass a file with text in it.")
        if path.endswith(".jsonl"):
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    try:
                        records.append(_record(json.loads(line), text_field, prompt_field, completion_field))
                    except (json.JSONDecodeError, DataError) as err:
                        raise DataError(f"{path}:{number}: {err}") from None
        else:
            parts = text.split(separator) if separator else [text]
            records += [part for part in parts if part.strip()]
    if not records:
        raise DataError(f"no text in {len(files)} file(s) at {paths!r} (all empty); pass files with text in them.")
    return records


def read_text(path: str) -> str:
    """A file's text as UTF-8; DataError naming the file and the first bad byte's offset otherwise (text is never
    silently altered: a binary or wrongly encoded file would otherwise train on replacement characters)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise DataError(f"{path}: cannot be read ({err.strerror}).") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}, line "
                        f"{line}); convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out.") from None


def _record(row: Any, text_field: str, prompt_field: str | None, completion_field: str | None) -> Record:
    if isinstance(row, str):
        return row
    if not isinstance(row, dict):
        raise DataError(f"a record must be a JSON object or string, got {type(row).__name__}")
    if prompt_field and completion_field:
        if row.get(prompt_field) is None or row.get(completion_field) is None:
            raise DataError(f"record lacks {prompt_field!r} or {completion_field!r} (has {sorted(row)[:6]})")
        return (str(row[prompt_field]), str(row[completion_field]))
    if row.get(text_field) is None:
        raise DataError(f"record has no {text_field!r} field (has {sorted(row)[:6]}); pass text_field=")
    return str(row[text_field])


HF_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text",
                    ".arrow": "arrow"}
HF_SPEC_OPTIONS = {"split": str, "config": str, "text": str, "prompt": str, "completion": str, "max_records": int,
                   "streaming": bool}


def parse_hf_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """`[hf:]NAME[?key=value&...]` -> (NAME, options) with the options of `HF_SPEC_OPTIONS`, typed."""
    name, _, query = (spec[3:] if spec.startswith("hf:") else spec).partition("?")
    if not name:
        raise DataError(f"{spec!r} names no dataset; write hf:NAME (a Hub name, a saved folder or a data file).")
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        kind = HF_SPEC_OPTIONS.get(key)
        if kind is None:
            raise DataError(f"{spec!r}: unknown option {key!r}; the options are {sorted(HF_SPEC_OPTIONS)}.")
        try:
            options[key] = (value.lower() in ("1", "true", "yes") if kind is bool else kind(value))
        except ValueError:
            raise DataError(f"{spec!r}: option {key}={value!r} must be {kind.__name__}.") from None
    return name, options


def _local_data_files(name: str) -> tuple[str, list[str]] | None:
    """(builder, files) when `name` is a local data file, glob or folder of data files; None otherwise."""
    if os.path.isdir(name):
        files = [p for p in expand_paths(name) if os.path.splitext(p)[1] in HF_FILE_BUILDERS]
    elif any(ch in name for ch in "*?[") or os.path.isfile(name):
        files = expand_paths(name)
    else:
        return None
    builders = {HF_FILE_BUILDERS.get(os.path.splitext(p)[1]) for p in files}
    if not files or None in builders or len(builders) > 1:
        raise DataError(f"{name}: datasets reads one kind of data file at a time; found "
                        f"{sorted({os.path.splitext(p)[1] for p in files}) or 'none'} (it reads "
                        f"{', '.join(HF_FILE_BUILDERS)}).")
    builder = builders.pop()
    assert builder is not None  # refused above: a file datasets has no builder for
    return builder, files


def load_hf_rows(name: str, *, split: str = "train", config_name: str | None = None,
                 streaming: bool = False) -> tuple[Iterable[dict], list[str]]:
    """(rows, column names) of one split of a dataset through `datasets` (see the module docstring)."""
    try:
        import datasets
    except ImportError:
        raise DataError("reading a Hugging Face dataset needs the `datasets` package (pip install "
                        "'nnx-surgery[datasets]'); or export the text to .txt/.jsonl files and use "
                        "TokenBatches.from_files.") from None
    saved = os.path.isdir(name) and any(os.path.exists(os.path.join(name, f)) for f in
                                        ("dataset_info.json", "state.json", "dataset_dict.json"))
    local = None if saved else _local_data_files(name)
    try:
        if saved:
            data = datasets.load_from_disk(name)
            if isinstance(data, datasets.DatasetDict):
                if split not in data:
                    raise DataError(f"{name} has splits {sorted(data)}, not {split!r}; add ?split=NAME.")
                data = data[split]
        elif local is not None:
            data = datasets.load_dataset(local[0], data_files={split: local[1]}, split=split, streaming=streaming)
        else:
            data = datasets.load_dataset(name, config_name, split=split, streaming=streaming)
    except (ValueError, OSError) as error:  # unknown split / config / name, no network: with datasets' detail
        if isinstance(error, DataError):
            raise
        hint = "" if local or saved else " (a Hub name; offline, pass a local data file or save_to_disk folder)"
        raise DataError(f"cannot load split {split!r} of dataset {name!r}{hint}: {error}") from None
    return data, list(data.column_names or [])


def hf_dataset_records(name_or_path: str, *, split: str | None = None, text_field: str | None = None,
                       prompt_field: str | None = None, completion_field: str | None = None,
                       config_name: str | None = None, max_records: int | None = None,
                       streaming: bool | None = None) -> list[Record]:
    """Records of a dataset named as `parse_hf_spec` reads it; keyword arguments override the spec's options."""
    name, options = parse_hf_spec(name_or_path)
    pick = lambda value, key, default=None: value if value is not None else options.get(key, default)  # noqa: E731
    split, config_name = str(pick(split, "split", "train")), pick(config_name, "config")
    named_text, max_records = pick(text_field, "text"), pick(max_records, "max_records")
    text_field = named_text or "text"
    prompt_field, completion_field = pick(prompt_field, "prompt"), pick(completion_field, "completion")
    rows, columns = load_hf_rows(name, split=split, config_name=config_name,
                                 streaming=bool(pick(streaming, "streaming", False)))
    if (prompt_field is None) != (completion_field is None):
        raise DataError(f"dataset {name}: give both a prompt and a completion field (got prompt={prompt_field!r}, "
                        f"completion={completion_field!r}).")
    if not (prompt_field or named_text) and "text" not in columns and {"prompt", "completion"} <= set(columns):
        prompt_field, completion_field = "prompt", "completion"  # the prompt-completion layout
    wanted = [prompt_field, completion_field] if prompt_field else [text_field]
    if columns and not set(wanted) <= set(columns):
        raise DataError(f"dataset {name} (split {split!r}) has columns {columns}, not {wanted}; name the text "
                        "column with ?text=COLUMN, or a pair with ?prompt=COLUMN&completion=COLUMN.")
    rows = itertools.islice(rows, max_records) if max_records is not None else rows
    records = []
    for index, row in enumerate(rows):
        try:
            records.append(_record(row, text_field, prompt_field, completion_field))
        except DataError as error:
            raise DataError(f"dataset {name}, split {split!r}, row {index}: {error}") from None
    if not records:
        raise DataError(f"dataset {name} (split {split!r}) has no rows.")
    return records


def stdlib_corpus(max_bytes: int | None = None, seed: int | None = None) -> list[str]:
    """The Python standard library's .py files (tests and site-packages excluded), sorted: an offline corpus.

    With `max_bytes`, files are taken in sorted order (or in an order drawn from `seed`) while they fit; the
    chosen files are returned sorted. Deterministic for a given Python installation."""
    root = sysconfig.get_paths()["stdlib"]
    # pydoc_data holds the general-domain held-out prose (`general_prose`): never training text
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib", "pydoc_data"}
    files = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if not skip & set(os.path.relpath(p, root).split(os.sep)[:-1]) and _has_text(p))
    if max_bytes is None:
        return files
    order = range(len(files)) if seed is None else np.random.default_rng(seed).permutation(len(files))
    chosen, total = [], 0
    for index in order:
        size = os.path.getsize(files[index])
        if total + size <= max_bytes:
            chosen.append(files[index])
            total += size
    return sorted(chosen)


GENERAL_PARTS = {"heldout": (0, 1), "aside": (2,), "train": (3,)}


def general_prose(part: str = "heldout") -> list[str]:
    """English prose that ships with every Python install and that `stdlib_corpus` never contains: the pydoc
    topics (the language reference's sections as `help()` shows them, `pydoc_data/topics.py`), one document per
    distinct topic text, split by a hash of the text into fixed parts: `heldout` (about half: the general-domain
    evaluation set), `aside` (about a quarter, kept for a final check no choice was tuned on) and `train`
    (about a quarter, for a training mix with prose). The text is the running interpreter's, so it differs
    between Python versions (say which version a figure was measured with)."""
    if part not in GENERAL_PARTS:
        raise DataError(f"general_prose: part {part!r} unknown; choose from {sorted(GENERAL_PARTS)}.")
    path = os.path.join(sysconfig.get_paths()["stdlib"], "pydoc_data", "topics.py")
    if not os.path.exists(path):
        raise DataError(f"general_prose: {path} is missing (a Python install without pydoc_data); pass held-out "
                        "text of your own.")
    with open(path, encoding="utf-8") as handle:  # `topics = {...}`: read as a literal, nothing executed
        tree = ast.parse(handle.read(), path)
    topics = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(target, "id", None) == "topics" for target in node.targets))
    texts = sorted(set(topics.values()))  # some topics share one text under two names: each text once
    return [text for text in texts if zlib.crc32(text.encode()) % 4 in GENERAL_PARTS[part]]


def general_mix(corpus_bytes: int, fraction: float) -> list[str]:
    """Copies of `general_prose("train")` making about `fraction` of a corpus of `corpus_bytes` bytes plus them
    (at least one copy when `fraction` > 0): general text to train on beside a domain corpus, disjoint from the
    general-domain held-out set (`TokenBatches.from_files(..., extra_train=general_mix(...))`)."""
    if not 0.0 <= fraction < 1.0:
        raise DataError(f"general_mix: fraction {fraction} must lie in [0, 1).")
    if fraction == 0.0:
        return []
    prose = general_prose("train")
    size = sum(len(text.encode("utf-8")) for text in prose)
    copies = max(1, round(fraction / (1.0 - fraction) * corpus_bytes / size))
    return prose * copies


# prose files of a Python install that are neither .py source, pydoc topics nor Python's language reference: the
# history of Python, IDLE's change logs and notes, the email package's design notes
FAR_FILES = ("LICENSE.txt", "email/architecture.rst", "idlelib/NEWS.txt", "idlelib/NEWS2x.txt",
             "idlelib/HISTORY.txt", "idlelib/README.txt", "idlelib/TODO.txt", "idlelib/CREDITS.txt",
             "idlelib/extend.txt")
# LICENSE.txt is read up to its license terms: their permission notices also head some standard-library modules
FAR_ENDS = {"LICENSE.txt": "B. TERMS AND CONDITIONS"}


def far_prose(document_bytes: int = 2048) -> list[str]:
    """Prose from a source no training text of this package touches (`FAR_FILES`, LICENSE.txt without its license
    terms; `stdlib_corpus` reads .py files outside idlelib, `general_prose` the pydoc topics): the far-domain
    evaluation set. Each file is cut at blank
    lines into documents of about `document_bytes` (paired intervals come from documents, and nine files would be
    too few). Files a Python install lacks (a distribution may strip idlelib) are skipped; none at all is a
    DataError."""
    root = sysconfig.get_paths()["stdlib"]
    documents = []
    for name in FAR_FILES:
        path = os.path.join(root, *name.split("/"))
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        if name in FAR_ENDS:
            text = text.split(FAR_ENDS[name])[0]
        paragraphs = re.split(r"\n\s*\n", text)
        current = ""
        for paragraph in paragraphs:
            if current and len(current.encode("utf-8")) + len(paragraph.encode("utf-8")) > document_bytes:
                documents.append(current)
                current = ""
            current = f"{current}\n\n{paragraph}" if current else paragraph
        if current.strip():
            documents.append(current)
    documents = [text for text in documents if text.strip()]
    if not documents:
        raise DataError(f"far_prose: none of {', '.join(FAR_FILES)} is in {root}; pass far-domain text of your own.")
    return documents


def _has_text(path: str) -> bool:
    """Empty modules (many `__init__.py`) are no documents; a corpus of named files must not list them."""
    if os.path.getsize(path) == 0:
        return False
    with open(path, "rb") as handle:
        return bool(handle.read(4096).strip()) or os.path.getsize(path) > 4096
