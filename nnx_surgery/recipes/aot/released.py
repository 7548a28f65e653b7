"""The teacher's config.json alone, for `--aot`: no weights are read, downloaded or allocated.

    --teacher FOLDER          its config.json
    --teacher FILE.gguf       the config in the GGUF header
    --teacher gemma-7b        a released model's config shipped with the package (released_configs/; also by its
                              Hub id, e.g. google/gemma-7b), so a compile for a slice needs no network
    --teacher ORG/NAME        config.json alone, downloaded from the Hub
    --preset tiny             the tiny preset's teacher config (nothing trained)
"""
from __future__ import annotations

import json
import os

from nnx_surgery import surgery
from nnx_surgery.refusals import RecipeError
from nnx_surgery.recipes.config.sections import RecipeConfig
from nnx_surgery.recipes.inputs.tiny_teacher import TEACHER_CONFIG
from nnx_surgery.surgery.storage.gguf_import import GGUFFile, hf_config_dict

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "released_configs")


def released_sources() -> dict[str, str]:
    """{name: Hub id} of the configs shipped in released_configs/."""
    with open(os.path.join(FOLDER, "sources.json"), encoding="utf-8") as handle:
        return json.load(handle)


def released_name(text: str) -> str | None:
    """The packaged config that `text` names (gemma-7b, google/gemma-7b, Llama-3.2-1B, ...), or None."""
    key = text.lower()
    for name, repo in released_sources().items():
        if key in (name, repo.lower(), repo.lower().partition("/")[2]):
            return name
    return None


def released_path(name: str) -> str:
    return os.path.join(FOLDER, f"{name}.json")


def teacher_config(config: RecipeConfig) -> tuple[str, str, surgery.ModelConfig]:
    """(what the teacher is, where its config came from, the config) without reading any weights."""
    source = config.teacher.model
    if config.run.preset == "tiny" and source is None:
        return "the tiny preset's teacher", "tiny_teacher.TEACHER_CONFIG", surgery.ModelConfig.from_hf_dict(
            TEACHER_CONFIG, where="the tiny preset's teacher config")
    if source is None:
        raise RecipeError("--teacher: give the teacher (a Hub id, a folder or a .gguf file) to compile for.")
    if source == "gguf:gemma3-270m":
        source = "gemma-3-270m"
    if source.endswith(".gguf"):
        return source, source, _gguf_config(source)
    if os.path.isdir(os.path.expanduser(source)):
        path = os.path.join(os.path.expanduser(source), "config.json")
        return source, path, surgery.ModelConfig.from_file(path)
    name = released_name(source)
    if name is not None:
        path = released_path(name)
        return source, f"{path} (the released config, shipped with the package)", surgery.ModelConfig.from_file(path)
    path = _hub_config(source, config.teacher.revision)
    return source, path, surgery.ModelConfig.from_file(path)


def _gguf_config(path: str) -> surgery.ModelConfig:
    if not os.path.isfile(path):
        raise RecipeError(f"--teacher {path}: no such GGUF file.")
    file = GGUFFile(path)
    return surgery.ModelConfig.from_hf_dict(hf_config_dict(file.metadata, set(file.tensors), path), where=path)


def _hub_config(repo: str, revision: str | None) -> str:
    """config.json of Hub repo `repo`, downloaded alone."""
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download(repo, "config.json", revision=revision)
    except Exception as error:  # offline, gated, missing: say which and what works without the Hub
        raise RecipeError(f"--teacher {repo}: its config.json could not be fetched from the Hub "
                          f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); pass a "
                          f"folder with config.json, or a packaged config: {', '.join(released_sources())}.") from None


__all__ = ["teacher_config", "released_sources", "released_name", "released_path", "FOLDER"]
