"""Settings declared once for two layers: the distillation's (`DistillConfig`, in distill/, which imports jax) and
a subcommand's own (recipes/config/command_settings.py, which `nnx-surgery --help` reads without jax). Each
function returns a new dataclass field (a field belongs to one class) made from the same declaration, so the flag,
its help, reading and check are written here only.

Imports nothing but `field_docs`."""
from __future__ import annotations

from typing import Any

from nnx_surgery.field_docs import documented


def distill_top_k() -> Any:
    """--top-k: the distillation's divergence on the teacher's top K (compress's `distill.top_k`, the distill
    subcommand's `--top-k`)."""
    return documented(None, "divergence on the teacher's top-k logits only (less memory; the full vocabulary is "
                      "exact)", flag="--top-k", kind=int, metavar="K", check=("at least 1", lambda v: v >= 1),
                      none_means="the full vocabulary")


__all__ = ["distill_top_k"]
