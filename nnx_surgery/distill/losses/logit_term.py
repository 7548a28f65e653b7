"""The logit loss as one loss term: forward KL, reverse KL, JSD and hard-label CE are its kinds, each with its own
weight ("kl", "reverse_kl", "jsd", "ce"), computed together by the fused chunked loss of `divergence.py` (or its
full-logits reference with `logit_impl="reference"`, or in two passes over vocabulary slices with
`logit_impl="two_pass"`, `two_pass.py`, for the train step's forward KL / CE; the evaluation step's
full-vocabulary diagnostics stay on the fused path).

It is always computed, also when all its weights are 0 (e.g. a stage of feature matching only): it gives the
student's cross-entropy and the KL metrics. Then no gradient flows through it.

Its options are the static `LogitLossSettings` (`StepSettings.logit`), made by `loss_settings` from the
DistillConfig fields that have always held them (top_k, jsd_beta, logit_chunk, logit_block, logit_vocab_slice,
train_diagnostics): the chunking is sized here for the device the run is on.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, TypedDict

import jax
import jax.numpy as jnp

from .divergence import LogitLossSettings, fused_logit_loss, reference_logit_loss
from .tpu_kernel import kernel_applies, kernel_logit_loss, model_caps
from .two_pass import two_pass_applies, two_pass_logit_loss
from .term_types import LossTerm, TermInputs

KINDS = ("kl", "reverse_kl", "jsd", "ce")
KERNEL_IMPLS = ("kernel", "kernel_interpret")  # StepSettings.logit_impl of the TPU kernels (interpreted off a TPU)


class LogitKinds(TypedDict):
    """The `LogitLossSettings` switches of the logit term's kinds (KINDS)."""

    kl: bool
    reverse_kl: bool
    jsd: bool
    ce: bool
DEFAULT_LOGIT_BLOCK = 256  # rows: teacher logits and head-gradient matmuls at least this tall (faster on CPU)
CPU_LOGIT_CHUNK = 128  # rows: the fastest measured on CPU at 256-row blocks with the closed-form gradient
ACCELERATOR_LOGIT_CHUNK = 2048  # rows: larger chunks gained nothing measurable; small ones read the head per chunk


def logit_chunk(config: Any, device: jax.Device | None = None) -> int:
    """Rows per chunk of the fused loss: `config.logit_chunk` when set; else 128 on CPU, and on an accelerator
    2048 rows, halved (down to 256) until one (rows, 262144) float32 block (a Gemma 3 vocabulary) takes at most
    1/16 of the device's memory: 2048 on 80-141 GB GPUs, 512 on a TPU v5e (15.75 GiB usable). Small chunks make
    the student's logits matmul read the whole (V, D) head for a few rows at a time: on a v5e the 270M pair's step
    ran 23% faster at 512 rows than at 256 (BENCHMARKS.md, "On a TPU v5e chip")."""
    if config.logit_chunk:
        return config.logit_chunk
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return CPU_LOGIT_CHUNK
    stats = device.memory_stats() or {}
    return accelerator_logit_chunk(stats.get("bytes_limit"))


def accelerator_logit_chunk(device_bytes: int | None, vocab: int = 262144) -> int:
    rows = ACCELERATOR_LOGIT_CHUNK
    while device_bytes and rows > DEFAULT_LOGIT_BLOCK and rows * vocab * 4 > device_bytes / 16:
        rows //= 2
    return rows


def logit_block(config: Any) -> int:
    """Rows per teacher-logits / head-gradient block of the fused loss: `config.logit_block` when set, else
    max(chunk, 256). Costs one (block, V) float32 buffer; when the block covers the whole batch it also saves
    the (V, D) accumulator."""
    return max(logit_chunk(config), config.logit_block or DEFAULT_LOGIT_BLOCK)


def logit_vocab_slice(config: Any) -> int | None:
    """Vocabulary rows per head-gradient matmul of the fused loss: `config.logit_vocab_slice` when set, else
    32768 on CPU (XLA:CPU copies the (block, V) gradient transposed for that matmul; slices bound the copy at no
    measured cost) and None elsewhere (one matmul: GPU and TPU matmuls read either layout)."""
    if config.logit_vocab_slice:
        return config.logit_vocab_slice
    return 32768 if jax.default_backend() == "cpu" else None


def chosen_loss(impl: str, spec: LogitLossSettings, cached_teacher: bool, vocab: int, caps: tuple[Any, Any],
                devices: int | None = None) -> str:
    """The logit loss a step with `StepSettings.logit_impl` `impl` computes: "kernels" (the TPU kernels, where
    `kernel_applies`), else the XLA loss's name ("fused", "two_pass", "reference")."""
    if impl not in KERNEL_IMPLS:
        return impl
    return "kernels" if kernel_applies(spec, cached_teacher, vocab, caps, devices) else "fused"


@dataclasses.dataclass(frozen=True)
class LogitTerm(LossTerm):
    """The fused logit loss; its static settings are `StepSettings.logit` (a `LogitLossSettings`). The
    `sft_then_mix` fallback moves its cross-entropy weight, so a run with that policy compiles the CE kind in."""

    name: str = "logit"
    weights: tuple[str, ...] = KINDS
    teacher_free: tuple[str, ...] = ("ce",)
    fallbacks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: {"sft_then_mix": ("ce",)},
                                                                 hash=False)

    def kinds(self, weights: Mapping[str, float]) -> LogitKinds:
        """The `LogitLossSettings` switches of `weights`: a kind is on when its weight is not 0."""
        return LogitKinds(kl=weights["kl"] != 0, reverse_kl=weights["reverse_kl"] != 0, jsd=weights["jsd"] != 0,
                          ce=weights["ce"] != 0)

    def loss_settings(self, config: Any, weights: Mapping[str, float], has_teacher: bool) -> LogitLossSettings:
        # has_teacher: a teacher model or a teacher cache (whose top k come in the batch)
        """The static settings of a stage's logit loss: the kinds `weights` turn on (weights a fallback moves
        count as on), the run's top-k, JSD beta, chunking and diagnostics."""
        return LogitLossSettings(**self.kinds(weights), jsd_beta=config.jsd_beta, top_k=config.top_k,
                                 chunk=logit_chunk(config), block=logit_block(config),
                                 vocab_slice=(config.logit_vocab_slice if config.logit_impl == "two_pass"
                                              else logit_vocab_slice(config)),
                                 unit_temperature=config.unit_temperature,
                                 teacher=has_teacher, diagnostics=config.train_diagnostics,
                                 top_k_mode=getattr(config, "top_k_mode", "renormalised"))

    def contribution(self, inputs: TermInputs) -> tuple[jax.Array, dict[str, jax.Array]]:
        settings, teacher, student = inputs.settings, inputs.teacher, inputs.student
        spec = settings.logit
        trained = any(getattr(spec, kind) for kind in KINDS)
        coeffs: dict[str, jax.Array | float] = {key: inputs.hyper[key] for key in ("temperature", *KINDS)}
        if spec.unit_temperature:
            coeffs["temperature"] = 1.0
        # the fused loss takes the master-dtype head (cast once inside, gradient kept in the master dtype)
        s_hidden = student.required_hidden()
        s_head = student.model.head_matrix() if settings.logit_impl == "reference" else student.required_head()
        if not trained:  # logit metrics only: no gradient work in the fused loss
            s_hidden, s_head = jax.lax.stop_gradient(s_hidden), jax.lax.stop_gradient(s_head)
        cached = teacher is not None and teacher.topk is not None  # a teacher cache: its top k, no model
        if settings.logit_impl == "reference":
            t_logits = None if teacher is None else (
                teacher.topk if cached else teacher.model.logits_from_hidden(teacher.hidden, teacher.head))
            loss, sums = reference_logit_loss(student.model.logits_from_hidden(s_hidden, s_head), t_logits,
                                              inputs.labels, inputs.token_weights, coeffs, spec)
        else:
            t_input = None if teacher is None else (teacher.topk if cached else teacher.hidden)
            t_head = None if teacher is None else teacher.head
            caps = model_caps(student.model, None if teacher is None or cached else teacher.model)
            if chosen_loss(settings.logit_impl, spec, cached, s_head.shape[0], caps) == "kernels":
                loss, sums = kernel_logit_loss(s_hidden, s_head, t_input, t_head, inputs.labels, inputs.token_weights,
                                               coeffs, caps=caps, spec=spec,
                                               interpret=settings.logit_impl == "kernel_interpret")
            else:
                two_pass = settings.logit_impl == "two_pass" and two_pass_applies(spec, cached)
                loss, sums = (two_pass_logit_loss if two_pass else fused_logit_loss)(
                    s_hidden, s_head, t_input, t_head, inputs.labels, inputs.token_weights, coeffs,
                    student_logits=student.model.logits_from_hidden,
                    teacher_logits=None if teacher is None or cached else teacher.model.logits_from_hidden, spec=spec)
        total = loss if trained else jnp.zeros((), jnp.float32)
        return total, {"loss/logit": loss, **sums}


LOGIT = LogitTerm()

__all__ = ["LOGIT", "LogitTerm", "KINDS", "KERNEL_IMPLS", "chosen_loss", "logit_chunk", "accelerator_logit_chunk",
           "logit_block", "logit_vocab_slice"]
