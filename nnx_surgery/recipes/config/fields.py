"""From the declarations to the command line: argparse flags made from fields declared with
`nnx_surgery.field_docs.documented`, their help text, and the check of a value against its field's declaration.

Imports nothing heavy: `nnx-surgery COMMAND --help` builds its parser from these without jax."""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any, Callable

FIELD_KINDS = {int: "an integer", float: "a number"}


@dataclasses.dataclass(frozen=True)
class Declared:
    """One declared field: where it lives (`path`, e.g. ("training", "steps")), its dataclass field, and what is
    read from it: its metadata, flag, dotted path (`dest`), default and the name refusals call it by (its flag,
    else its dotted path)."""

    path: tuple[str, ...]
    field: dataclasses.Field
    meta: Any
    flag: str | None
    dest: str
    default: Any
    name: str


def declared(kind: type, prefix: tuple[str, ...] = ()) -> list[Declared]:
    """Every field of dataclass `kind` and of the dataclasses nested in its defaults, with their paths."""
    out = []
    for field in dataclasses.fields(kind):
        path, flag = (*prefix, field.name), field.metadata.get("flag")
        default = field.default if field.default is not dataclasses.MISSING else \
            field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default) and not flag:
            out.extend(declared(type(default), path))
        else:
            dest = ".".join(path)
            out.append(Declared(path, field, field.metadata, flag, dest, default, flag or dest))
    return out


def reader(kind: type | None, flag: str = "") -> Callable[[str], Any] | None:
    """argparse's `type` for a flag of `kind`: a finite int or float; the error names the text."""
    if kind not in (int, float):
        return None

    def read(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {FIELD_KINDS[kind]}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        return value
    read.__name__ = kind.__name__  # argparse names the type in its messages
    return read


def add_flag(group: Any, item: Declared, *, dest: str | None = None, default: Any = argparse.SUPPRESS,
             help_default: str | None = None, help: str | None = None, required: bool = False) -> None:
    """The flag of `item` (its declaration's name, spellings, reading, choices and action) on `group`, storing
    into `dest` (default: the dotted path). `default` SUPPRESS: only given flags reach the namespace; `help`: what
    the setting means in this command, instead of the declaration's; `required`: a command that cannot run
    without it (its default then is no default)."""
    meta = item.meta
    keywords: dict[str, Any] = dict(dest=dest or item.dest, default=default, required=required,
                                    help=help_text(item, "required" if required else help_default,
                                                   help).replace("%", "%%"))
    action = meta.get("action")
    if action == "append" and isinstance(default, tuple):
        keywords["default"] = list(default)  # argparse appends to it
    if action == "boolean":
        keywords["action"] = argparse.BooleanOptionalAction
    elif action:
        keywords["action"] = action
    if action in (None, "append"):
        keywords["type"] = reader(meta.get("kind"), item.flag or "")
        if meta.get("choices"):
            keywords["choices"] = meta["choices"]
        if meta.get("metavar") or not meta.get("choices"):  # not the dotted destination
            keywords["metavar"] = meta.get("metavar") or item.name.lstrip("-").replace("-", "_").upper()
    if meta.get("shortcut"):  # the flag and its shortcut set one setting: both given is a contradiction, refused
        group = group.add_mutually_exclusive_group()
    group.add_argument(item.flag, *meta.get("also", ()), **keywords)
    if meta.get("shortcut"):
        flag, value, why = meta["shortcut"]
        group.add_argument(flag, dest=keywords["dest"], action="store_const", const=value, default=default,
                           help=why)


def option_dest(item: Declared) -> str:
    """Where a command's parser stores a declared setting: its flag's name (`--max-new-tokens` -> max_new_tokens)."""
    return item.name.lstrip("-").replace("-", "_")


def add_option(group: Any, item: Declared, help: str | None = None, required: bool = False) -> None:
    """`item`'s flag for a command other than compress: stored under its flag's name, its declared default."""
    add_flag(group, item, dest=option_dest(item), default=item.default, help=help, required=required)


def refusals_of(args: argparse.Namespace, items: list[Declared]) -> list[str]:
    """The values of `items` given in `args` (under their flags' names) that their declarations refuse: one line
    each, naming the flag."""
    errors = []
    for item in items:
        value = getattr(args, option_dest(item), None)
        why = check(item, value)
        if why:
            errors.append(f"{item.name} {value}: {why}.")
    return errors


def help_text(item: Declared, default: str | None = None, help: str | None = None) -> str:
    """The help (or `help`), why the default is what it is, and the default (or `default`, e.g. a preset's)."""
    meta = item.meta
    text = help or meta.get("help", "")
    if meta.get("why"):
        text += f" ({meta['why']})"
    if default is None:
        default = default_text(item)
    return f"{text} [{default}]" if default else text


def default_text(item: Declared, value: Any = dataclasses.MISSING) -> str:
    value = item.default if value is dataclasses.MISSING else value
    if item.meta.get("action") == "store_false" or (item.meta.get("saved") is False and value is False):
        return ""  # a --no-... flag, or a switch of how the command runs
    if value is None:
        return f"default: {item.meta['none_means']}" if item.meta.get("none_means") else ""
    return f"default: {list(value) if isinstance(value, tuple) else value}"


def check(item: Declared, value: Any) -> str | None:
    """Why `value` does not fit `item`'s declaration (None: it fits): its kind, choices and check."""
    meta = item.meta
    if value is None:
        return None
    kind = meta.get("kind")
    if meta.get("action") in ("store_true", "store_false", "boolean"):
        kind = bool
    if kind is bool and not isinstance(value, bool):
        return "give true or false"
    if kind in (int, float) and not _number(value, kind):
        return f"give {FIELD_KINDS[kind]}"
    choices = meta.get("choices")
    if choices and meta.get("action") != "append" and value not in choices:
        return f"choose from {', '.join(map(str, choices))}"
    rule = meta.get("check")
    if rule and not rule[1](value):
        return f"give {rule[0]}"
    return None


def _number(value: Any, kind: type) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return kind is float or float(value).is_integer()


__all__ = ["Declared", "declared", "add_flag", "add_option", "option_dest", "refusals_of", "help_text", "default_text", "check", "reader"]
