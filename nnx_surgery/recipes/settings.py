"""The recipe's settings: defaults < preset < named schedule < config file (--config) < command-line flags < --set.

A config file (JSON, or YAML with pyyaml installed) holds the recipe's own settings under the flags' names
(`"steps": 24`, `"frozen": ["embed_tokens"]`, `"temperature": [3, 1]`) and a `"distill"` section read by
`DistillConfig.from_dict`: stages (their freeze patterns, loss weights and ramps, lengths in steps or epochs),
optimizer, remat, checkpointing, guard, targets, OOM, logger and the rest. What the recipe sets itself from its
own settings (batch size, sequence length, precision, mesh, seed, run folders, the surgery plan) is refused in
the distill section with the setting to use instead. `resolved_config` is the result with every default filled
in: `--print-config` prints it and every run saves it as `resolved_config.json`, which `--config` reads back to
the same settings.

`resolve` returns them as `Flags`, a frozen record (lists become tuples, mappings read-only) with the values that
follow from the flags alone (warm-up, learning rates, eval_every, the temperature ramp, tokens per step, the compute
dtype, the control's name); `run_settings.resolve` adds what needs the teacher. Nothing writes them afterwards.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import re
import sys
from typing import Any

import jax

from nnx_surgery import distill
from nnx_surgery import surgery
import nnx_surgery.surgery.gguf_export  # noqa: F401  (surgery.gguf_export below)
from nnx_surgery.distill.config import NESTED
from nnx_surgery.recipes import phases
from nnx_surgery.recipes.cli import MULTI_HOST_FLAGS, RecipeError
from nnx_surgery.recipes.frozen import freeze, thaw
from nnx_surgery.recipes.knobs import (DEFAULTS, DISTILL_FLAGS, MANAGED, PRESETS, SCHEDULE_DEFAULTS, SCHEDULES, add_arguments,
                           distill_epilog, term_weight_defaults)

FORMAT = "nnx-surgery recipe config 1"
AOT_FLAGS = ("aot", "aot_tokens", "aot_mfu", "aot_search")  # --aot's: a compile of the run, not the run
# how this invocation runs, not what it computes: never saved
RUN_ONLY = ("config", "print_config", "output", "resume", "overwrite", "halt_after", "dry_run", "push_to_hub",
            "public", "cache_dir", "set", "no_scratch", *AOT_FLAGS, *MULTI_HOST_FLAGS)
MANAGED_CHECKPOINT = ("directory", "resume")
CONTROL_NAMES = {"scratch": "scratch student (same shape)", "pruned-ce": "CE-retrained pruned student (control)"}
# what follows from the flags alone, beside them in Flags (not saved: resolved_config repeats it from the flags)
FLAG_DERIVED = ("distill", "tokens_per_step", "compute_dtype", "control_name")

Flags = dataclasses.make_dataclass(
    "Flags", [(name, Any) for name in dict.fromkeys((*RUN_ONLY, *DEFAULTS, *FLAG_DERIVED))], frozen=True,
    namespace={"__module__": __name__, "__doc__": "Every recipe setting after layering, frozen: one field per flag of knobs.py (the fields "
               "are made from its tables, so a flag is declared once) and FLAG_DERIVED."})


FLAG_FIELDS = frozenset(field.name for field in dataclasses.fields(Flags))


@functools.lru_cache(maxsize=None)
def flags_type(extra: tuple[str, ...]) -> type:
    """Flags, or a subclass with `extra` fields: the weight flags of loss terms registered after this module was
    imported (knobs.term_flags), so that a new term's flag works without a second declaration."""
    if not extra:
        return Flags
    return dataclasses.make_dataclass("Flags", [(name, Any) for name in extra], bases=(Flags,), frozen=True,
                                      namespace={"__module__": __name__})


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are the toolkit's: one line naming the flag and pointing to --help, exit code 2 (not
    the whole usage first)."""

    def error(self, message: str):
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def build_parser(description: str = "", prog: str = "gemma_7b_to_2b.py") -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog=prog, description=description or "Compress a causal LM: plan, prune, distil, save.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=distill_epilog(),
        argument_default=argparse.SUPPRESS)
    add_arguments(parser)
    return parser


def resolve(argv: list[str] | None = None, description: str = "", prog: str = "gemma_7b_to_2b.py") -> Flags:
    """Parse the command line, read --config and layer everything (module docstring): every recipe setting,
    `distill` (the resolved distill section), the run-only flags and the values derived from them, checked."""
    given = vars(build_parser(description, prog).parse_args(argv))
    file = load_config_file(given["config"]) if given.get("config") else {}
    file_distill = file.pop("distill", None) or {}
    file.pop("format", None)
    unknown = sorted(set(file) - set(DEFAULTS) - set(DISTILL_FLAGS))
    if unknown:
        raise RecipeError(f"--config {given['config']}: unknown settings {unknown}; the recipe's settings are the "
                          "flags' names (see --help), DistillConfig's go in the \"distill\" section.")
    flags = {k: v for k, v in given.items() if k not in RUN_ONLY}
    if given.get("no_scratch"):  # a run-only flag, so not among `flags`
        flags["control"] = "none"
    preset = flags.get("preset", file.get("preset", DEFAULTS["preset"]))
    if preset not in PRESETS:
        raise RecipeError(f"preset {preset!r} unknown; choose from {sorted(PRESETS)}.")
    schedule = flags.get("schedule", file.get("schedule", DEFAULTS["schedule"]))
    settings = {**DEFAULTS, **PRESETS[preset], **SCHEDULE_DEFAULTS.get(schedule, {})}
    for layer in (file, flags):
        settings.update({k: v for k, v in layer.items() if k not in DISTILL_FLAGS})
    section = distill_section(file_distill, [file, flags], given.get("set") or [], given.get("config"))
    values = {**{key: given.get(key) for key in RUN_ONLY}, **settings, "distill": section}
    values["cache_dir"] = values["cache_dir"] or os.environ.get("NNX_SURGERY_CACHE",
                                                                os.path.expanduser("~/.cache/nnx-surgery"))
    values = _derive(values)
    flags = flags_type(tuple(key for key in values if key not in FLAG_FIELDS))(**freeze(values))
    check(flags)
    return flags


def distill_section(file_distill: dict, layers: list[dict], overrides: list[str], source: str | None) -> dict:
    """DistillConfig's defaults, then the file's distill section, then the distill flags (file top level, then
    the command line), then --set KEY=VALUE."""
    section = {k: v for k, v in distill.DistillConfig().to_dict().items() if k not in MANAGED}
    section["stages"] = None  # None: the recipe builds its stages from its settings (or --schedule)
    for key in MANAGED_CHECKPOINT:
        section["checkpoint"].pop(key)
    _merge(section, file_distill, f"--config {source}: distill")
    for layer in layers:
        for flag, path in DISTILL_FLAGS.items():
            if flag in layer:
                _put(section, path, None if (flag, layer[flag]) == ("remat", "none") else layer[flag])
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise RecipeError(f"--set {item!r}: write KEY=VALUE, e.g. --set guard.mse_weight=2.0.")
        path = tuple(key.strip().split("."))
        if path[0] == "distill":
            path = path[1:]
        _merge(section, _nest(path, _value(text)), "--set")
    return section


def _merge(section: dict, update: dict, where: str) -> None:
    for key, value in update.items():
        if key in MANAGED:
            instead = f"; use the recipe setting {MANAGED[key]!r}" if MANAGED[key] else ""
            raise RecipeError(f"{where}.{key}: the recipe sets it{instead}.")
        if key not in section:
            raise RecipeError(f"{where}.{key}: no such setting; DistillConfig's are {', '.join(sorted(section))}.")
        if key in NESTED and isinstance(value, dict):
            refused = sorted(set(value) & set(MANAGED_CHECKPOINT)) if key == "checkpoint" else []
            if refused:
                raise RecipeError(f"{where}.checkpoint.{refused[0]}: the recipe keeps checkpoints in --output "
                                  "and resumes with --resume.")
            unknown = sorted(set(value) - set(section[key]))
            if unknown:
                raise RecipeError(f"{where}.{key}: unknown keys {unknown}; it takes {', '.join(section[key])}.")
            section[key].update(copy.deepcopy(value))
        else:
            section[key] = copy.deepcopy(value)


def _put(section: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        section = section[key]
    section[path[-1]] = list(value) if isinstance(value, tuple) else value


def _nest(path: tuple[str, ...], value: Any) -> dict:
    for key in reversed(path):
        value = {key: value}
    return value


def _value(text: str) -> Any:
    """--set values are JSON (2.0, true, null, ["a"], {"x": 1}); anything else is a string."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def load_config_file(path: str) -> dict:
    """A JSON or YAML (.yaml / .yml, needs pyyaml) mapping."""
    if not os.path.isfile(path):
        raise RecipeError(f"--config {path}: no such file.")
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


def _derive(values: dict) -> dict:
    """Settings whose default depends on others, written out so the resolved config states them, and the values
    that follow from the flags alone (FLAG_DERIVED)."""
    steps, rate = values["steps"], values["learning_rate"]
    derived = dict(warmup_steps=steps // 50, scratch_learning_rate=rate, teacher_correction_lr=rate / 10,
                   search_steps=max(3, steps // 10))
    values.update({key: value for key, value in derived.items() if values[key] is None})
    if values["distill"].get("eval_every") is None:
        values["distill"]["eval_every"] = max(1, steps // 4)
    values["temperature"] = parse_ramp(values["temperature"], "--temperature")
    for key in ("frozen", "trainable"):
        if isinstance(values[key], str):
            values[key] = [values[key]]
    if values["schedule"] in SCHEDULES:
        values["schedule_options"] = {**SCHEDULES[values["schedule"]], **(values["schedule_options"] or {})}
    values.update(tokens_per_step=values["batch_size"] * values["seq_len"] * values["distill"]["grad_accum"],
                  compute_dtype="bfloat16" if values["precision"] == "bf16" else "float32",
                  control_name=CONTROL_NAMES.get(values["control"]))
    return values


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


def check(args: Flags) -> None:
    """Refuse impossible combinations now, before any model is loaded or anything written (the run's lengths,
    rates and sizes; the output against the inputs; last, --push-to-hub's token and Hub)."""
    _check_numbers(args)
    if args.eval_tokens < 64:
        raise RecipeError(f"--eval-tokens {args.eval_tokens}: a held-out set needs at least 64 scored tokens "
                          "(thousands to decide between students).")
    if not 0.0 <= args.general_mix < 1.0:
        raise RecipeError(f"--general-mix {args.general_mix}: give the share of general text, in [0, 1).")
    if args.gguf is not None:
        try:
            surgery.gguf_export.resolve_export_dtype(args.gguf)
        except ValueError as err:
            raise RecipeError(f"--gguf {args.gguf}: {err}") from None
    for flag, value, fine, need in (
            ("--search-candidates", args.search_candidates, args.search_candidates >= 1, "at least 1 shape"),
            ("--search-steps", args.search_steps, args.search_steps >= 1, "at least 1 step per candidate"),
            ("--search-tolerance", args.search_tolerance, 0 < args.search_tolerance < 1, "a fraction in (0, 1), "
             "e.g. 0.05")):
        if not fine:
            raise RecipeError(f"{flag} {value}: give {need}.")
    if args.teacher_correction < 0:
        raise RecipeError(f"--teacher-correction {args.teacher_correction}: give a number of steps >= 0.")
    if args.schedule not in ("none", *SCHEDULES):
        raise RecipeError(f"--schedule {args.schedule!r}: choose none or one of {sorted(SCHEDULES)}.")
    if args.schedule != "none" and args.distill.get("stages"):
        raise RecipeError(f"--schedule {args.schedule} and stages in the config's distill section both set the "
                          "distillation stages; keep one.")
    if args.schedule == "progressive" and args.trainable:
        raise RecipeError("--trainable cannot be combined with --schedule progressive, which sets what trains in "
                          "each stage; use --frozen for patterns to keep frozen throughout.")
    try:  # what the stages are built from; they are built once the student's depth is known (run_settings)
        phases.check_stage_settings(args)
    except RecipeError:
        raise
    except (ValueError, TypeError, ArithmeticError) as error:  # DistillConfig's fields named as the recipe's flags
        flags = {path[-1]: flag for flag, path in DISTILL_FLAGS.items()}
        text = re.sub(r"\b(\w+)=", lambda m: f"--{flags[m.group(1)].replace('_', '-')} " if m.group(1) in flags
                      else m.group(0), str(error))
        raise RecipeError(f"distill settings: {text}") from None
    _check_output(args)


def _check_numbers(args: Flags) -> None:
    """The run's length, rates, warm-up, row sizes, mesh and parameter budget."""
    if args.steps < 1:
        raise RecipeError(f"--steps {args.steps}: give at least 1 optimizer step.")
    if not 0.0 <= args.alpha <= 1.0:
        raise RecipeError(f"--alpha {args.alpha}: give a weight in [0, 1] (1: forward KL alone, 0: cross-entropy "
                          "alone).")
    for flag, value in (("--learning-rate", args.learning_rate), ("--scratch-learning-rate",
                        args.scratch_learning_rate), ("--teacher-correction-lr", args.teacher_correction_lr)):
        if value is not None and not 0 < value < math.inf:
            raise RecipeError(f"{flag} {value}: give a finite learning rate above 0, e.g. 3e-4.")
    if args.warmup_steps is not None and not 0 <= args.warmup_steps <= args.steps:
        raise RecipeError(f"--warmup-steps {args.warmup_steps}: give from 0 to --steps {args.steps} warm-up steps "
                          "(a longer warm-up never reaches the peak learning rate).")
    if not 0 <= args.seed < 2 ** 32:
        raise RecipeError(f"--seed {args.seed}: give a whole number from 0 to {2 ** 32 - 1}.")
    if args.seq_len < 2 or args.batch_size < 1:
        raise RecipeError(f"--seq-len {args.seq_len} / --batch-size {args.batch_size}: give at least 2 tokens per "
                          "row and 1 row per batch.")
    if args.mesh:  # its axes, and that they fit the devices unless a dry run or --aot sizes another machine's
        from nnx_surgery.distill.mesh import MeshError, make_mesh, parse_mesh_spec
        try:
            if args.dry_run or args.aot:
                parse_mesh_spec(args.mesh)
            else:
                make_mesh(args.mesh, devices=args.mesh_devices)
        except MeshError as error:
            raise RecipeError(f"--mesh {args.mesh!r}: {error}") from None
    weights = {name: ("a weight >= 0", lambda v: v >= 0) for name in term_weight_defaults()}
    for name, (need, fine) in {**RANGES, **weights}.items():
        value = getattr(args, name, None)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or not fine(value)):
            raise RecipeError(f"--{name.replace('_', '-')} {value}: give {need}.")
    _check_budget(args.student)
    _check_data(args.data)


RANGES = {"corpus_bytes": ("at least 1 byte", lambda v: v >= 1), "teacher_steps": ("0 or more steps", lambda v: v >= 0),
          "stage_a_fraction": ("a share of --steps in (0, 1)", lambda v: 0 < v < 1),
          "kv_warmup": ("a share of --steps in [0, 1)", lambda v: 0 <= v < 1),
          "calibration_samples": ("0 or more rows", lambda v: v >= 0), "eval_batches": ("at least 1", lambda v: v >= 1),
          "eval_prompts": ("0 or more prompts", lambda v: v >= 0), "new_tokens": ("at least 1", lambda v: v >= 1),
          "choice_items": ("0 or more items", lambda v: v >= 0),
          "eval_tasks_limit": ("at least 1 document", lambda v: v >= 1),
          "aot_tokens": ("a token budget above 0, e.g. 94e9", lambda v: v > 0),
          "aot_mfu": ("the share of the peak FLOP/s a step reaches, in (0, 1], e.g. 0.4", lambda v: 0 < v <= 1)}  # flags with no other check (None: the default)


def _check_data(data: Any) -> None:
    """Local --data that names no file, or only empty ones, refused before the run folder is written (the text
    itself is read, and checked, once the teacher's tokenizer is known)."""
    if not isinstance(data, str) or not data or data.startswith("hf:"):
        return
    try:
        files = distill.sources.expand_paths(data)
    except distill.DataError as error:
        raise RecipeError(f"--data: {error}") from None
    named_empty = os.path.isfile(data) and os.path.getsize(data) < 1 << 20 and \
        not distill.sources.read_text(data).strip()
    if named_empty or all(os.path.getsize(path) == 0 for path in files):
        raise RecipeError(f"--data {data}: no text there (empty); pass files with text in them.")


def _check_budget(student: str | None) -> None:
    """A `--student params=` budget readable now (a fraction up to 1, or a count), before anything is written."""
    for item in (student or "").split(","):
        key, _, value = (part.strip() for part in item.partition("="))
        if key == "params":
            try:
                surgery.search_space.parse_budget(value)
            except surgery.SpecError as error:
                raise RecipeError(f"--student {student!r}: {error}") from None


def _check_output(args: Flags) -> None:
    """--output never an input the run reads (--teacher, --data) nor inside one or holding one: --overwrite deletes
    it (--config is read whole before that: `--config RUN/resolved_config.json --output RUN` repeats or resumes a
    run); and --push-to-hub's token and Hub checked now, not after the run."""
    from nnx_surgery.commands import guard_folder, input_paths

    if args.output is not None:
        guard_folder(args.output, "--output", input_paths(args.teacher, args.data))
    if args.push_to_hub and not args.print_config:
        from nnx_surgery.surgery.hub import check_push_access
        check_push_access(args.push_to_hub)


def resolved_config(args: Flags) -> dict:
    """Every setting of the run (run-only flags left out), as JSON data --config reads back to the same."""
    out = {"format": FORMAT}
    out.update({key: thaw(getattr(args, key)) for key in DEFAULTS})
    out["distill"] = thaw(args.distill)
    return out


def save_resolved(args: Flags, folder: str) -> str:
    """Write resolved_config.json into the run folder (`check_resumable` first)."""
    path = check_resumable(args, folder)
    if jax.process_index() == 0:  # multi-host: the run folder is shared, process 0 writes it
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(resolved_config(args), handle, indent=2)
    return path


def check_resumable(args: Flags, folder: str) -> str:
    """The path of the run's resolved_config.json. Resuming a run with other settings than it started with is
    refused (the checkpoints were made under those), naming the settings that differ."""
    path = os.path.join(folder, "resolved_config.json")
    if args.resume and os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            before = json.load(handle)
        now = resolved_config(args)
        differ = sorted(key for key in set(before) | set(now) if before.get(key) != now.get(key))
        if differ:
            raise RecipeError(f"--resume: the settings {differ} differ from the run's own ({path}); resume it "
                              f"as it was with --config {path} --resume, or start over with --overwrite.")
    return path


__all__ = ["Flags", "build_parser", "resolve", "resolved_config", "save_resolved", "check_resumable",
           "load_config_file", "parse_ramp",
           "CONTROL_NAMES"]
