"""The recipe's settings, layered once: field defaults < preset < named schedule < --config < flags < --set.

A config file (JSON, or YAML with pyyaml) holds sections named as `RecipeConfig`'s (`"training": {"steps": 24}`)
and a `"distill"` section read as `DistillConfig` (its stages, optimizer, guard, targets, loss_options and the
rest). Files of the first format (every setting at the top level under its flag's name, as runs before the
sectioned format saved them) are read as well: each key goes where its flag's declaration is. What the recipe
manages in DistillConfig (sizes, precision, mesh, seed, run folders, the plan) is refused in the distill section
with the setting to use instead. `--set KEY=VALUE` reaches any field by its dotted path (`training.steps`,
`distill.loop.guard.mse_weight`, or a DistillConfig path alone: `guard.mse_weight`). `saved_config` is the result
with every default filled in: --print-config prints it, every run saves it as resolved_config.json, and --config
reads it back to the same settings.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import types
from importlib import resources
from typing import Any, Mapping

from nnx_surgery.distill import terms
from nnx_surgery.distill.loop.run_config import DistillConfig, moved_options
from nnx_surgery.field_docs import documented
from nnx_surgery.recipes.config import fields
from nnx_surgery.recipes.config.sections import SECTIONS, RecipeConfig
from nnx_surgery.refusals import RecipeError, wrong_kind

FORMAT = "nnx-surgery recipe config 2"
FIRST_FORMAT = "nnx-surgery recipe config 1"
# DistillConfig fields the recipe fills in from its own settings, and the setting to use instead
MANAGED = {"batch_size": "data.batch_size (--batch-size)", "seq_len": "data.seq_len (--seq-len)",
           "compute_dtype": "training.precision (--precision)", "mesh": "training.mesh (--mesh)",
           "mesh_devices": "training.mesh_devices (--mesh-devices)", "seed": "run.seed (--seed)",
           "eval_batches": "evaluation.batches (--eval-batches)", "plan": None, "run_dir": "--output",
           "halt_after": "--halt-after", "plots": None}
MANAGED_CHECKPOINT = ("directory", "resume")


def data_file(name: str) -> dict:
    """presets/NAME.json, shipped with the package."""
    return json.loads(resources.files("nnx_surgery.recipes.config").joinpath("presets", name).read_text())


def preset(name: str) -> dict:
    if name not in PRESET_FILES:
        raise RecipeError(f"preset {name!r} unknown; choose from {sorted(PRESET_FILES)}.")
    values = data_file(f"{name}.json")
    values.pop("about", None)
    return values


PRESET_FILES = ("7b", "gemma3-270m", "gemma3-270m-tpu", "tiny")
SCHEDULES = {name: value for name, value in data_file("schedules.json").items() if name != "about"}


def term_weight_fields() -> list[fields.Declared]:
    """`--<term>-weight` for every registered loss term with a recipe flag: training.term_weights.<term>."""
    kind = dataclasses.make_dataclass("TermWeights", [
        (t.name, float, documented(0.0, t.flag, flag=f"--{t.name}-weight".replace("_", "-"), kind=float,
                                          check=("a weight >= 0", lambda v: v >= 0))) for t in terms.flagged()])
    return fields.declared(kind, ("training", "term_weights"))


def term_option_fields() -> list[fields.Declared]:
    """`--<term>-<option>` for every term option with a flag: distill.loss_options.<term>.<option>."""
    out = []
    for term in terms.registered():
        options = [o for o in term.options if o.flag]
        if options:
            kind = dataclasses.make_dataclass("TermOptions", [
                (o.name, Any, documented(o.default, o.flag, flag=f"--{term.name}-{o.name}".replace("_", "-"),
                                                choices=o.choices, kind=type(o.default) if not o.choices else None))
                for o in options])
            out.extend(fields.declared(kind, ("distill", "loss_options", term.name)))
    return out


def distill_fields() -> list[fields.Declared]:
    return [item for item in fields.declared(DistillConfig, ("distill",)) if item.path[1] not in MANAGED]


def every_field() -> list[fields.Declared]:
    """Every declared setting of a compress run: the sections', the loss terms' and the distill section's."""
    recipe = [item for name, kind in SECTIONS.items() for item in fields.declared(kind, (name,))
              if item.path[:2] != ("training", "term_weights")]  # the terms' registry declares their flags
    return recipe + term_weight_fields() + distill_fields() + term_option_fields()


def first_format_keys() -> dict[str, tuple[str, ...]]:
    """The first format's top-level keys (the flags' names: `eval_tokens`, `feature_weight`, `top_k`) -> paths."""
    out = {}
    for item in every_field():
        if item.flag:
            name = item.flag.lstrip("-").replace("-", "_")
            out[name[3:] if item.meta.get("action") == "store_false" and name.startswith("no_") else name] = item.path
        elif item.path[0] != "distill":
            out[item.path[-1]] = item.path
    return out


def sectioned(data: Mapping[str, Any], where: str) -> dict:
    """A config file's settings in sections: the first format's top-level keys moved where they now live."""
    data = dict(data)
    data.pop("format", None)
    data.pop("about", None)
    if all(key in SECTIONS or key == "distill" for key in data):
        return data
    keys, out = first_format_keys(), {}
    defaults = {item.path: item.default for item in every_field()}
    distill = data.pop("distill", None) or {}
    for key, value in data.items():
        if key not in keys:
            raise RecipeError(f"{where}: unknown setting {key!r}; the recipe's settings are in sections "
                              f"({', '.join(SECTIONS)}, distill): see --print-config.")
        if value is None and defaults.get(keys[key]) is not None:
            continue  # the first format's "unused here" (e.g. corpus_bytes with --data): the default now
        put(out, keys[key], value)
    if isinstance(distill, dict):
        merge(out.setdefault("distill", {}), distill)
    return out


def put(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def merge(tree: dict, update: Mapping[str, Any]) -> dict:
    """`update` into `tree`: mappings merged key by key, anything else replaced (a copy)."""
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(tree.get(key), dict):
            merge(tree[key], value)
        else:
            tree[key] = copy.deepcopy(dict(value) if isinstance(value, Mapping) else value)
    return tree


def checked_layer(layer: Mapping[str, Any], where: str) -> dict:
    """A layer's keys checked against the declarations: unknown sections and fields, and what the recipe manages
    in the distill section, are refused naming them. The main stages written out may also be given as
    distill.stages (DistillConfig's name for them): they are training.stages."""
    layer = dict(layer)
    if isinstance(layer.get("distill"), Mapping) and "stages" in layer["distill"]:
        distill = dict(layer["distill"])
        stages = distill.pop("stages")
        layer["distill"] = distill
        if stages is not None:
            layer["training"] = {**layer.get("training", {}), "stages": stages}
    for section, values in layer.items():
        if section == "distill":
            layer[section] = _checked_distill(values, where)
            continue
        if section not in SECTIONS:
            raise RecipeError(f"{where}: no section {section!r}; the sections are {', '.join(SECTIONS)}, distill.")
        if not isinstance(values, Mapping):
            raise RecipeError(f"{where}: {section} must hold a mapping of settings, not {values!r}.")
        names = [f.name for f in dataclasses.fields(SECTIONS[section])]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise RecipeError(f"{where}: {section}.{unknown[0]}: no such setting; the {section} section's are "
                              f"{', '.join(names)}.")
    return layer


def _checked_distill(values: Any, where: str) -> dict:
    if not isinstance(values, Mapping):
        raise RecipeError(f"{where}: distill must hold a mapping of DistillConfig settings, not {values!r}.")
    values = moved_options(dict(values))  # feature_kind, guard.mse_on: where older configs held them
    for key, value in values.items():
        if key in MANAGED:
            instead = f"; use the recipe setting {MANAGED[key]}" if MANAGED[key] else ""
            raise RecipeError(f"{where}: distill.{key}: the recipe sets it{instead}.")
        if key == "checkpoint" and isinstance(value, Mapping) and set(value) & set(MANAGED_CHECKPOINT):
            refused = sorted(set(value) & set(MANAGED_CHECKPOINT))[0]
            raise RecipeError(f"{where}: distill.checkpoint.{refused}: the recipe keeps checkpoints in --output "
                              "and resumes with --resume.")
    return values


def set_layer(items: list[str]) -> dict:
    """--set KEY=VALUE items as one layer: KEY a dotted path into a section or the distill section (a
    DistillConfig path alone means the distill section's), VALUE JSON (2.0, true, null, ["a"]) or a string."""
    layer: dict = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"--set {item!r}: write KEY=VALUE, e.g. --set training.steps=100 or "
                              "--set guard.mse_weight=2.0.")
        path = tuple(key.strip().split("."))
        if path[0] not in SECTIONS and path[0] != "distill":
            path = ("distill", *path)
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        merge(layer, _nest(path, value))
    return layer


def _nest(path: tuple[str, ...], value: Any) -> dict:
    for key in reversed(path):
        value = {key: value}
    return value


def flag_layer(given: Mapping[str, Any]) -> dict:
    """The parsed flags (dotted destinations) as one layer."""
    layer: dict = {}
    for dest, value in given.items():
        put(layer, tuple(dest.split(".")), list(value) if isinstance(value, (list, tuple)) else value)
    return layer


def defaults_tree() -> dict:
    """Every declared default as a layer: the sections' and the distill section's (DistillConfig's fields but
    what the recipe manages and the stages, which it builds; term options only where given)."""
    tree: dict = {name: {} for name in SECTIONS}
    for item in every_field():
        if item.path[0] == "distill" and (item.path[1] in ("stages", "loss_options") or
                                          item.path[1:] in (("checkpoint", key) for key in MANAGED_CHECKPOINT)):
            continue
        put(tree, item.path, thaw(item.default))
    return tree


def thaw(value: Any) -> Any:
    """Plain JSON data: mappings as dicts, tuples as lists, all the way down."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(item) for item in value]
    return value


def freeze(value: Any) -> Any:
    """Lists as tuples and mappings read-only, all the way down (the frozen sections' values)."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({key: freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value


def layered(given: Mapping[str, Any], file: Mapping[str, Any] | None, overrides: list[str],
            source: str | None) -> dict:
    """The settings tree: defaults < preset < schedule < file < flags < --set, each layer checked."""
    where = f"--config {source}"
    file_layer = checked_layer(sectioned(file, where), where) if file else {}
    flags, sets = flag_layer(given), checked_layer(set_layer(overrides), "--set")
    chosen = [layer.get("run", {}).get("preset") for layer in (sets, flags, file_layer)]
    name = next((value for value in chosen if value is not None), "7b")
    preset_layer = checked_layer(preset(name), f"preset {name}")
    picked = [layer.get("training", {}).get("schedule") for layer in (sets, flags, file_layer, preset_layer)]
    schedule = next((value for value in picked if value is not None), "none")
    schedule_layer = checked_layer(SCHEDULES.get(schedule, {}).get("settings", {}), f"schedule {schedule}")
    tree = defaults_tree()
    for layer in (preset_layer, schedule_layer, file_layer, flags, sets):
        merge(tree, layer)
    return tree



def load_config_file(path: str) -> dict:
    """A JSON or YAML (.yaml / .yml, needs pyyaml) mapping."""
    if not os.path.isfile(path):
        raise RecipeError(f"--config {path}: {wrong_kind(path, 'file')}; give a JSON or YAML file of settings.")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise RecipeError(f"--config {path}: YAML needs pyyaml (pip install pyyaml), or use JSON.") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise RecipeError(f"--config {path}: not valid YAML: {error}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise RecipeError(f"--config {path}: not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"--config {path}: the file must hold a mapping of settings, not {type(data).__name__}.")
    return data

__all__ = ["load_config_file", "FORMAT", "FIRST_FORMAT", "MANAGED", "SCHEDULES", "every_field", "layered", "sectioned", "set_layer",
           "freeze", "thaw", "merge", "put", "preset"]
