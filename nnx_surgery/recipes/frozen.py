"""Frozen settings values: lists as tuples and mappings read-only (`freeze`), and back to JSON data (`thaw`)."""
from __future__ import annotations

import types
from typing import Any, Mapping


def freeze(value: Any) -> Any:
    """Lists as tuples and mappings read-only, all the way down."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({key: freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(item) for item in value)
    return value


def thaw(value: Any) -> Any:
    """`freeze` undone: plain dicts and lists (JSON data, a copy the caller may change)."""
    if isinstance(value, Mapping):
        return {key: thaw(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(item) for item in value]
    return value


__all__ = ["freeze", "thaw"]
