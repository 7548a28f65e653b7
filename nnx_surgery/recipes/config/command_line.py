"""The compress command line, made from the declarations: one flag per declared field that has one, grouped by
section, with its help, why and default (a preset's where the presets differ); parsed once."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from nnx_surgery.distill.loop.run_config import DistillConfig
from nnx_surgery.recipes.config import fields
from nnx_surgery.recipes.config.layering import (MANAGED, PRESET_FILES, distill_fields, preset, term_option_fields,
                                                 term_weight_fields)
from nnx_surgery.recipes.config.sections import SECTION_TITLES, SECTIONS
from nnx_surgery.secrets import redact

DISTILL_TITLE = "Distillation (the distill section: DistillConfig)"


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are the toolkit's: one line naming the flag and pointing to --help, exit code 2 (not
    the whole usage first), with secrets masked; no abbreviations, so that a near-miss is named as unknown."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):

        print(redact(f"error: {message} (see `{self.prog} --help`)", sys.argv[1:]), file=sys.stderr)
        sys.exit(2)


def build_recipe_parser(description: str = "", prog: str = "gemma_7b_to_2b.py") -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog, description=description or "Compress a causal LM: plan, prune, distil, save.",
                           formatter_class=argparse.RawDescriptionHelpFormatter, epilog=distill_epilog())
    presets = {name: preset(name) for name in PRESET_FILES}
    for name, kind in SECTIONS.items():
        group = parser.add_argument_group(SECTION_TITLES[name])
        if name == "run":
            group.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                               help="settings from a JSON/YAML file (a run's resolved_config.json repeats it "
                               "exactly); flags given here override it")
            group.add_argument("--set", action="append", metavar="KEY=VALUE", default=argparse.SUPPRESS,
                               help="set any setting by its dotted path, e.g. --set training.steps=100, --set "
                               "guard.mse_weight=2.0 (DistillConfig's, listed below) or --set "
                               "'targets.kl_below=0.05' (JSON values); repeatable, wins over all")
        items = [item for item in fields.declared(kind, (name,)) if item.flag]
        if name == "training":
            items += term_weight_fields()
        for item in items:
            fields.add_flag(group, item, help_default=preset_default(item, presets))
    group = parser.add_argument_group(DISTILL_TITLE)
    for item in distill_fields() + term_option_fields():
        if item.flag:
            fields.add_flag(group, item)
    return parser


def preset_default(item: fields.Declared, presets: dict[str, dict]) -> str | None:
    """"default by preset: 7b 20000, gemma3-270m 20, tiny 240; otherwise ..." where a preset sets the field."""
    by_preset = {}
    for name, values in presets.items():
        value: Any = values
        for key in item.path:
            value = value.get(key, dataclasses.MISSING) if isinstance(value, dict) else dataclasses.MISSING
        if value is not dataclasses.MISSING:
            by_preset[name] = value
    if not by_preset:
        return None
    text = "default by preset: " + ", ".join(f"{name} {value}" for name, value in by_preset.items())
    if len(by_preset) < len(presets):
        text += f"; otherwise {fields.default_text(item).removeprefix('default: ') or 'none'}"
    return text


def parse_recipe_flags(argv: list[str] | None, description: str = "", prog: str = "gemma_7b_to_2b.py"
          ) -> tuple[dict[str, Any], str | None, list[str]]:
    """(the flags given, by dotted path; --config's file; --set's items)."""
    given = vars(build_recipe_parser(description, prog).parse_args(argv))
    return given, given.pop("config", None), given.pop("set", None) or []


def distill_epilog() -> str:
    """The distill section's settings (config file "distill": {...} or --set KEY=VALUE) with their defaults."""
    lines = ["DistillConfig settings (config file \"distill\" section, or --set KEY=VALUE), with defaults:"]
    for field in dataclasses.fields(DistillConfig):
        if field.name in MANAGED or field.name == "stages":
            continue
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if dataclasses.is_dataclass(default):
            default = ", ".join(f"{f.name}={getattr(default, f.name)}" for f in dataclasses.fields(default))
        help_text = field.metadata.get("help", "")
        lines.append(f"  {field.name} = {default}" + (f"  ({help_text})" if help_text else ""))
    return "\n".join(lines)


__all__ = ["build_recipe_parser", "parse_recipe_flags", "OneLineParser", "distill_epilog"]
