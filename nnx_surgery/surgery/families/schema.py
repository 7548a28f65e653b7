"""The tensor schema: every tensor of a model family declared once, with named axes (as penzai names them).

A family (nnx_surgery/surgery/families/) lists its tensors as `Tensor` declarations: the Hugging Face name, the NNX path, the
named axes of the NNX parameter, how those axes group into the checkpoint's axes, whether it is an RMSNorm
weight (and which activation stream it normalises), and when it exists. Everything that needs the family's
shape derives from this list, so nothing else knows it by heart:

    loading and saving        `tensor_table(config)`: HF name <-> NNX path and layout (hf_checkpoint.py)
    the model's parameters    `declared_tensor(config, name)`: shape, logical axes (causal_lm.py)
    the surgery               `Tensor.axes`: a plan prunes by axis name (tensor_slices.py)
    importance scores         tensors that read/write the residual (`embed`), heads and MLP neurons (importance.py)
    norm lists                `norm_names(config)`, `Tensor.reads` (student_planner.py, importance.py)
    shardings                 the logical axes through one rules table (sharding.py)
    GGUF names                `Tensor.gguf` (gguf_import.py)

Axis names and their sizes in a config:

    vocab      vocab_size                 embed     hidden_size           mlp      intermediate_size
    heads      num_attention_heads        kv_heads  num_key_value_heads   head_dim head_dim
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

AXIS_SIZES = {"vocab": "vocab_size", "embed": "hidden_size", "mlp": "intermediate_size",
              "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "head_dim": "head_dim"}
LAYER = "{i}"  # stands for the layer index in per-layer names and paths


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a family, per layer when its name contains "{i}".

    `axes` names the NNX parameter's axes; `hf_axes` groups them into the checkpoint's axes (q_proj's NNX
    (heads, head_dim, embed) is HF's [heads * head_dim, embed]: `(("heads", "head_dim"), ("embed",))`); None means
    one HF axis per NNX axis. `norm`: an RMSNorm weight, in the family's norm form; `reads` names the activation
    stream it normalises (a model capture: "residual", "mid_residual", "attention_outputs", "mlp_outputs", or
    "final_residual" for the final norm). `when` names a boolean config property the tensor needs ("!" negates).
    `role`: "embedding" (the token table, tied head too), "head" (an untied LM head) or "" (anything else).
    `gguf`: llama.cpp's name, where the family has a GGUF importer."""

    hf_name: str
    axes: tuple[str, ...]
    hf_axes: tuple[tuple[str, ...], ...] | None = None
    norm: bool = False
    reads: str = ""
    when: str = ""
    role: str = ""
    gguf: str = ""

    @property
    def path(self) -> tuple:
        """NNX path template: the HF name without `model.`, norms' `weight` as `scale`, the table and an untied
        head as bare parameters."""
        parts = self.hf_name.removeprefix("model.").split(".")
        if self.role in ("embedding", "head"):
            parts = parts[:-1]
        elif self.norm:
            parts[-1] = "scale"
        return tuple(parts)

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        return self.hf_axes if self.hf_axes is not None else tuple((axis,) for axis in self.axes)

    @property
    def layout(self) -> str:
        """same | split_rows (HF [A*B, C] -> (A, B, C)) | split_cols (HF [A, B*C] -> (A, B, C)) | flat ([A*B])."""
        sizes = tuple(len(group) for group in self.groups)
        return {(1,) * len(self.axes): "same", (2, 1): "split_rows", (1, 2): "split_cols", (2,): "flat"}[sizes]

    @property
    def per_layer(self) -> bool:
        return LAYER in self.hf_name

    @property
    def is_bias(self) -> bool:
        return self.hf_name.endswith(".bias")

    def present(self, config: Any) -> bool:
        if not self.when:
            return True
        negate, name = self.when.startswith("!"), self.when.lstrip("!")
        return bool(getattr(config, name)) != negate

    def at(self, layer: int | None) -> "BoundTensor":
        if layer is None:
            return BoundTensor(self, self.hf_name, self.path, None)
        path = tuple(layer if part == LAYER else part for part in self.path)
        return BoundTensor(self, self.hf_name.replace(LAYER, str(layer)), path, layer)


@dataclasses.dataclass(frozen=True)
class BoundTensor:
    """A declaration at one layer: concrete HF name and NNX path (`layer` None for global tensors)."""

    decl: Tensor
    hf_name: str
    path: tuple
    layer: int | None

    @property
    def layout(self) -> str:
        return self.decl.layout

    @property
    def axes(self) -> tuple[str, ...]:
        return self.decl.axes

    @property
    def module(self) -> str:
        """The tensor's module name within its layer or model, e.g. "q_proj", "input_layernorm", "norm"."""
        return self.path[-2] if len(self.path) > 1 else self.path[0]

    @property
    def gguf_name(self) -> str:
        return self.decl.gguf.replace(LAYER, str(self.layer))


def axis_size(config: Any, axis: str) -> int:
    return int(getattr(config, AXIS_SIZES[axis]))


def nnx_shape(config: Any, tensor: Tensor | BoundTensor) -> tuple[int, ...]:
    return tuple(axis_size(config, axis) for axis in tensor.axes)


def hf_shape_of(config: Any, tensor: Tensor | BoundTensor) -> tuple[int, ...]:
    decl = tensor.decl if isinstance(tensor, BoundTensor) else tensor
    return tuple(math.prod(axis_size(config, axis) for axis in group) for group in decl.groups)


def declarations(config: Any) -> tuple[Tensor, ...]:
    """The family's declarations present for `config` (per-layer ones once, unbound)."""
    return tuple(t for t in config.family.tensors if t.present(config))


def bound_tensors(config: Any) -> list[BoundTensor]:
    """Every tensor of a checkpoint for `config`, in the order transformers writes them: global tensors declared
    before the layers, the layers in order, then the rest."""
    decls = declarations(config)
    first_layer = next((i for i, t in enumerate(decls) if t.per_layer), len(decls))
    last_layer = max((i for i, t in enumerate(decls) if t.per_layer), default=first_layer - 1)
    out = [t.at(None) for t in decls[:first_layer]]
    layer_decls = [t for t in decls if t.per_layer]
    for i in range(config.num_hidden_layers):
        out += [t.at(i) for t in layer_decls]
    out += [t.at(None) for t in decls[last_layer + 1:] if not t.per_layer]
    return out


def declared_tensor(config: Any, name: str) -> Tensor:
    """The declaration whose NNX path ends with `name` (dotted, layer index left out), e.g. "self_attn.q_proj.weight"
    or "embed_tokens": what the model builds its parameters from."""
    wanted = tuple(name.split("."))
    for tensor in config.family.tensors:
        path = tuple(p for p in tensor.path if p not in ("layers", LAYER))
        if path[-len(wanted):] == wanted and tensor.present(config):
            return tensor
    raise KeyError(f"{config.model_type} declares no tensor {name!r}")


def norm_tensors(config: Any, *, per_layer: bool = True) -> tuple[Tensor, ...]:
    """RMSNorm weights over the hidden axis (the ones hidden-channel pruning changes)."""
    return tuple(t for t in declarations(config) if t.norm and t.axes == ("embed",) and t.per_layer == per_layer)


def norm_names(config: Any) -> tuple[str, ...]:
    """Per-layer hidden-size norms by module name, in declaration order."""
    return tuple(t.at(0).module for t in norm_tensors(config))


__all__ = ["Tensor", "BoundTensor", "AXIS_SIZES", "axis_size", "nnx_shape", "hf_shape_of", "declarations",
           "bound_tensors", "declared_tensor", "norm_tensors", "norm_names"]
