"""Settings that document themselves: a dataclass field whose metadata says what it holds and, where a command line
offers it, the flag that sets it. The recipe's configuration (nnx_surgery/recipes/config/) and DistillConfig declare
their fields with it, and the command lines, --help and the defaults file are made from those declarations.
Imports nothing, so `nnx-surgery --help` stays instant."""
from __future__ import annotations

import dataclasses
from typing import Any

# what a field's metadata may hold besides `help`
FLAG_KEYS = ("flag", "also", "kind", "choices", "action", "metavar", "none_means", "why", "check", "saved",
             "none_word", "shortcut")


def documented(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = dataclasses.MISSING,
               **flag: Any) -> Any:
    """A dataclass field with `help` (what --help prints for it) and optionally:

    flag        "--name": the command-line flag that sets it (every command that offers it uses this declaration)
    also        other spellings of the flag
    kind        int, float or str: how the flag's text is read
    choices, action ("store_true", "store_false", "append", "boolean"), metavar: as argparse takes them
    none_means  what None does (printed as the default)
    why         why the default is what it is
    check       (what is needed, predicate): a value the predicate refuses is refused naming the flag
    saved       False for how a run is invoked rather than what it computes (never written to its config)
    none_word   the flag's word for None (e.g. --remat none)
    shortcut    (flag, value, help): a second flag that sets this field to `value`
    """
    unknown = sorted(set(flag) - set(FLAG_KEYS))
    if unknown:
        raise TypeError(f"documented(): unknown metadata {unknown}; use {', '.join(FLAG_KEYS)}.")
    metadata = {"help": help, **flag}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, hash=False, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


__all__ = ["documented", "FLAG_KEYS"]
