"""Where distillation text comes from: text files (a file, a folder, a glob; `.jsonl` lines are records), HF
`datasets` (when the package is installed), and the Python standard library's source as an offline corpus. A
record is a text, or a (prompt, completion) pair whose prompt is not trained on (`distill.data` packs them)."""
from __future__ import annotations

import glob
import json
import os
import sysconfig
from typing import Any, Sequence

import numpy as np

Record = str | tuple[str, str]  # text, or (prompt, completion)


class DataError(ValueError):
    """The data source, tokenizer or batch settings cannot work; the message says how to fix it."""



def expand_paths(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """A file, a folder (all files below it, sorted) or a glob pattern (`**` allowed), or a list of those."""
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: list[str] = []
    for item in map(os.fspath, items):
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
    if prompt_field and completion_field:
        if prompt_field not in row or completion_field not in row:
            raise DataError(f"record lacks {prompt_field!r} or {completion_field!r} (has {sorted(row)[:6]})")
        return (str(row[prompt_field]), str(row[completion_field]))
    if text_field not in row:
        raise DataError(f"record has no {text_field!r} field (has {sorted(row)[:6]}); pass text_field=")
    return str(row[text_field])


def hf_dataset_records(name_or_path: str, *, split: str = "train", text_field: str = "text",
                       prompt_field: str | None = None, completion_field: str | None = None,
                       config_name: str | None = None, max_records: int | None = None) -> list[Record]:
    """Records from HF `datasets`: a folder saved with `save_to_disk`, a local data folder, or a Hub name."""
    try:
        import datasets
    except ImportError:
        raise DataError("reading a Hugging Face dataset needs the `datasets` package (pip install datasets); "
                        "or export the text to .txt/.jsonl files and use TokenBatches.from_files.") from None
    if os.path.isdir(name_or_path) and any(os.path.exists(os.path.join(name_or_path, f)) for f in
                                           ("dataset_info.json", "state.json", "dataset_dict.json")):
        data = datasets.load_from_disk(name_or_path)
        data = data[split] if isinstance(data, datasets.DatasetDict) else data
    else:
        data = datasets.load_dataset(name_or_path, config_name, split=split)
    rows = data if max_records is None else data.select(range(min(max_records, len(data))))
    return [_record(row, text_field, prompt_field, completion_field) for row in rows]


def stdlib_corpus(max_bytes: int | None = None, seed: int | None = None) -> list[str]:
    """The Python standard library's .py files (tests and site-packages excluded), sorted: an offline corpus.

    With `max_bytes`, files are taken in sorted order (or in an order drawn from `seed`) while they fit; the
    chosen files are returned sorted. Deterministic for a given Python installation."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "idlelib"}
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


def _has_text(path: str) -> bool:
    """Empty modules (many `__init__.py`) are no documents; a corpus of named files must not list them."""
    if os.path.getsize(path) == 0:
        return False
    with open(path, "rb") as handle:
        return bool(handle.read(4096).strip()) or os.path.getsize(path) > 4096
