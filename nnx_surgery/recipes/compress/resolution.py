"""The command line to a `RecipeConfig`: parsed once, layered (layering.py), the defaults that follow from other
settings written out, every value checked against its declaration, and built into the frozen sections and the
run's `DistillConfig`. Nothing here touches a device (a multi-host run starts jax.distributed after it)."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from nnx_surgery.distill import terms
from nnx_surgery.distill.loop.run_config import DistillConfig
from nnx_surgery.distill.mesh import MeshError
from nnx_surgery.recipes.compress import checks, phase_configs
from nnx_surgery.recipes.config import command_line, fields, layering
from nnx_surgery.recipes.config.sections import SECTIONS, RecipeConfig
from nnx_surgery.refusals import RecipeError


def resolve(argv: list[str] | None = None, description: str = "", prog: str = "gemma_7b_to_2b.py") -> RecipeConfig:
    """Every setting of the run from the command line (and its --config file), checked, frozen."""
    given, source, overrides = command_line.parse_recipe_flags(argv, description, prog)
    file = layering.load_config_file(source) if source else None
    config = build_config(layering.layered(given, file, overrides, source))
    checks.check_settings(config)
    return config


def build_config(tree: dict) -> RecipeConfig:
    """The settings tree (layering.layered) with its derived defaults filled in, checked and frozen."""
    derive(tree)
    for item in layering.every_field():
        value = lookup(tree, item.path)
        if value is not dataclasses.MISSING:
            if item.meta.get("none_word") is not None and value == item.meta["none_word"]:
                value = None  # e.g. --remat none
                layering.put(tree, item.path, value)
            why = fields.check(item, value)
            if why:
                raise RecipeError(f"{item.name} {_shown(value)}: {why}.")
    sections = {name: kind(**{key: layering.freeze(value) for key, value in tree[name].items()})
                for name, kind in SECTIONS.items()}
    config = RecipeConfig(**sections)
    distill = distill_config(tree["distill"], config)
    return dataclasses.replace(config, distill=distill)


def _shown(value: Any) -> str:
    return str(list(value)) if isinstance(value, tuple) else str(value)


def lookup(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return dataclasses.MISSING
        tree = tree[key]
    return tree


def derive(tree: dict) -> None:
    """Settings whose default depends on others, written out so the resolved config states them."""
    training, run = tree["training"], tree["run"]
    steps, rate = training["steps"], training["learning_rate"]
    for item in layering.every_field():  # the settings others derive from: refused as written, not as derived
        if item.path in (("training", "steps"), ("training", "learning_rate")):
            why = fields.check(item, lookup(tree, item.path))
            if why:
                raise RecipeError(f"{item.name} {_shown(lookup(tree, item.path))} ({item.dest}): {why}.")
    if isinstance(steps, int) and isinstance(rate, (int, float)):
        for section, key, value in (("training", "warmup_steps", steps // 50),
                                    ("student", "scratch_learning_rate", rate),
                                    ("teacher", "correction_lr", rate / 10),
                                    ("search", "steps", max(3, steps // 10))):
            if tree[section][key] is None:
                tree[section][key] = value
        if tree["distill"].get("eval_every") is None:
            tree["distill"]["eval_every"] = max(1, steps // 4)
    training["temperature"] = parse_ramp(training["temperature"], "--temperature")
    given = training["term_weights"] or {}
    unknown = sorted(set(given) - {term.name for term in terms.flagged()})
    if unknown:
        raise RecipeError(f"training.term_weights: no loss term {unknown[0]!r} with a weight setting; the terms are "
                          f"{', '.join(term.name for term in terms.flagged())} (any other weight goes in "
                          "training.stages).")
    training["term_weights"] = {term.name: given.get(term.name, 0.0) for term in terms.flagged()}
    for key in ("frozen", "trainable"):
        if isinstance(training[key], str):
            training[key] = [training[key]]
    schedule = layering.SCHEDULES.get(training["schedule"])
    if schedule is not None:
        training["schedule_options"] = {**schedule["options"], **(training["schedule_options"] or {})}
    run["cache_dir"] = run["cache_dir"] or os.environ.get("NNX_SURGERY_CACHE",
                                                          os.path.expanduser("~/.cache/nnx-surgery"))


def parse_ramp(value: Any, flag: str) -> float | list:
    """3 -> 3.0; "3:1" or [3, 1] -> [3.0, 1.0] (start to end over the run); "3:1:cosine" keeps the shape."""
    parts = value.split(":") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) \
        else [value]
    try:
        numbers = [float(p) for p in parts[:2]]
    except (TypeError, ValueError):
        raise RecipeError(f"{flag} {value!r}: give a number (2.0) or a ramp START:END (3:1).") from None
    if len(parts) > 3 or not all(0 < n < math.inf for n in numbers) or \
            (len(parts) == 3 and parts[2] not in ("linear", "cosine")):
        raise RecipeError(f"{flag} {value!r}: values must be positive and finite, as N or START:END[:linear|cosine].")
    if len(numbers) == 1 or numbers[0] == numbers[1]:
        return numbers[0]
    return numbers + ([parts[2]] if len(parts) == 3 and parts[2] != "linear" else [])


def managed_values(config: RecipeConfig) -> dict[str, Any]:
    """The DistillConfig fields the recipe sets from its own settings."""
    return {"batch_size": config.data.batch_size, "seq_len": config.data.seq_len,
            "compute_dtype": config.training.compute_dtype, "mesh": config.training.mesh,
            "mesh_devices": config.training.mesh_devices, "seed": config.run.seed,
            "eval_batches": config.evaluation.batches, "plots": False}


def replaced(config: RecipeConfig, **changes: dict[str, Any]) -> RecipeConfig:
    """`config` with some settings changed, by section (`replaced(config, training={"mesh": "fsdp=8"},
    distill={"remat": "layers"})`), the distill section's copies of the recipe's own settings kept in step."""
    sections = {name: dataclasses.replace(getattr(config, name), **values) for name, values in changes.items()
                if name != "distill"}
    config = dataclasses.replace(config, **sections)
    distill = dataclasses.replace(config.distill, **{**changes.get("distill", {}), **managed_values(config)})
    return dataclasses.replace(config, distill=distill)


def distill_config(section: dict, config: RecipeConfig) -> DistillConfig:
    """The run's DistillConfig: the distill section, the recipe's own sizes, precision, mesh, seed and evaluation
    batches, and the one stage the flags make (each phase replaces it: phase_configs.py)."""
    values = {**section, **managed_values(config)}
    with checks.named_by_flags():
        try:
            return DistillConfig.from_dict({**values, "stages": [
                phase_configs.flag_stage(config, "main", config.training.steps)]})
        except MeshError as error:
            raise RecipeError(f"--mesh {config.training.mesh!r}: {error}") from None


__all__ = ["resolve", "build_config", "derive", "parse_ramp", "distill_config", "managed_values", "replaced"]
