"""A run's resolved_config.json written, and compared on --resume (the --config file itself is read by
recipes/config/layering.py)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax

from nnx_surgery.recipes.config import layering
from nnx_surgery.recipes.config.sections import SECTIONS, RecipeConfig
from nnx_surgery.recipes.compress.resolution import build_config
from nnx_surgery.refusals import RecipeError


def saved_config(config: RecipeConfig) -> dict:
    """Every setting of the run that decides what it computes (not how it is invoked: fields declared
    saved=False), as JSON data that --config reads back to the same settings."""
    out: dict = {"format": layering.FORMAT}
    for name in SECTIONS:
        values = section_values(getattr(config, name), saved_only=True)
        if values:
            out[name] = values
    distill = {key: value for key, value in config.distill.to_dict().items()
               if key not in layering.MANAGED and key != "stages"}
    for key in layering.MANAGED_CHECKPOINT:
        distill["checkpoint"].pop(key, None)
    out["distill"] = distill
    return out


def section_values(section: Any, saved_only: bool = False) -> dict:
    """A section's fields as JSON data (with `saved_only`, those declared saved)."""
    return {field.name: layering.thaw(getattr(section, field.name)) for field in dataclasses.fields(section)
            if not saved_only or field.metadata.get("saved", True)}


def save_resolved(config: RecipeConfig, folder: str) -> str:
    """Write resolved_config.json into the run folder (`check_resumable` first)."""
    path = check_resumable(config, folder)
    if jax.process_index() == 0:  # multi-host: the run folder is shared, process 0 writes it
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(saved_config(config), handle, indent=2)
    return path


def check_resumable(config: RecipeConfig, folder: str) -> str:
    """The path of the run's resolved_config.json. Resuming a run with other settings than it started with is
    refused (the checkpoints were made under those), naming the settings that differ; a run saved in the first
    format is compared in sections."""
    path = os.path.join(folder, "resolved_config.json")
    if config.run.resume and os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            before = json.load(handle)
        now = saved_config(config)
        before = comparable(before, path) if before.get("format") != layering.FORMAT else with_defaults(before)
        differ = sorted(differences(before, now))
        if differ:
            raise RecipeError(f"--resume: the settings {differ} differ from the run's own ({path}); resume it "
                              f"as it was with --config {path} --resume, or start over with --overwrite.")
    return path


def comparable(before: dict, path: str) -> dict:
    """A first-format resolved_config.json as the sectioned one: its settings moved where they now live over
    the defaults they had then."""
    tree = layering.defaults_tree()
    layering.merge(tree, layering.checked_layer(layering.sectioned(before, path), path))
    return saved_config(build_config(tree))


def with_defaults(before: dict) -> dict:
    """A sectioned resolved_config.json with the settings added since it was saved (e.g. data.general_source) read
    as their defaults, which the run ran with."""
    return layering.merge(saved_config(build_config(layering.defaults_tree())), before)


def differences(before: dict, now: dict, prefix: str = "") -> list[str]:
    """The dotted paths at which two saved configs differ."""
    out = []
    for key in sorted(set(before) | set(now)):
        a, b = before.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and key != "format":
            out.extend(differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


__all__ = ["saved_config", "section_values", "save_resolved", "check_resumable"]
