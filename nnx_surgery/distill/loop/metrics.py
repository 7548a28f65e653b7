"""Run metrics: FLOP accounting and MFU, a JSONL log, a progress bar, TensorBoard when installed, PNG curves, and
Weights & Biases when asked (`make_logger`; `DistillConfig.logger="wandb"`, the `wandb` extra).

FLOPs per step (matmuls only, the usual 6N / 2N convention for a trained / forward-only model):

    tokens * (6 N_student + 2 N_teacher) + tokens * (3 A_student + A_teacher)

N is the number of parameters in matrices (ndim >= 2). With tied embeddings the table is counted once, as the LM
head matmul (the input lookup is a gather); an untied model's input table is counted too, overstating by V*D.
A is attention score and value FLOPs per token, 4 * T * heads * head_dim per layer for the full T x T block as
computed (read from `model.config` when it has Gemma-like fields; 0 otherwise). The student term uses 6 N even for
frozen parameters (their weight gradients are skipped, so MFU is a slight overestimate when much is frozen).
MFU = FLOPs / (step time * devices * peak), with the peak per device from the config or the table below (dense
bf16); unknown devices (CPU) get no MFU unless `peak_flops` is configured.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from typing import Any, Mapping, Protocol, Sequence

import jax
from flax import nnx

from .wandb_logger import WandbSink, redact_values

log = logging.getLogger("distill")
# events that mean the run is not going as configured: logged at WARNING, the others at INFO
WARNING_EVENTS = frozenset({"rollback", "fallback", "oom", "low_utilisation", "checkpoint_unreadable"})

PEAK_BF16_FLOPS = {  # per device, dense
    "H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 125e12,
    "TPU v6 lite": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12,
}


def matrix_parameters(model: nnx.Module) -> int:
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)) if x.ndim >= 2))


def attention_flops_per_token(model: Any, seq_len: int) -> float:
    try:
        cfg = model.config
        return 4.0 * seq_len * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    except AttributeError:
        return 0.0


def unused_head_parameters(model: Any) -> int:
    """Head weights a forward never multiplies: a teacher seen in a trimmed student's vocabulary
    (`TeacherInStudentVocabulary`) computes its logits at the kept pieces only."""
    count = getattr(model, "unused_head_parameters", None)
    return int(count()) if callable(count) else 0


def step_flops(student: nnx.Module, teacher: nnx.Module | None, tokens: int, seq_len: int) -> float:
    per_token = 6 * matrix_parameters(student) + 3 * attention_flops_per_token(student, seq_len)
    if teacher is not None:
        per_token += (2 * (matrix_parameters(teacher) - unused_head_parameters(teacher))
                      + attention_flops_per_token(teacher, seq_len))
    return float(tokens) * per_token


def device_peak_flops(configured: float | None = None) -> float | None:
    if configured:
        return float(configured)
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_BF16_FLOPS.items():
        if name.lower() in kind.lower():
            return peak
    return None


def _tensorboard_writer(folder: str):
    try:
        SummaryWriter = _tensorboardx_writer_class()
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter  # type: ignore  # needs the tensorboard package
        except ImportError:
            return None
    return SummaryWriter(folder)


def _tensorboardx_writer_class():
    """tensorboardX's SummaryWriter, imported without PyTorch. tensorboardX imports torch whenever it is installed,
    only to accept torch tensors; we log Python floats. Importing torch costs a training process about 2 s of CPU
    and a few hundred MB (bench/NOTES.md), so while tensorboardX loads, `import torch` fails as if torch were
    absent (which tensorboardX handles) unless the process has imported torch already; afterwards torch imports
    normally."""
    hidden = "torch" not in sys.modules
    if hidden:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter  # type: ignore
    finally:
        if hidden and sys.modules.get("torch", False) is None:
            del sys.modules["torch"]
    return SummaryWriter


def scalars(record: Mapping[str, Any], prefix: str, skip: Sequence[str] = ("step", "eval")) -> dict[str, float]:
    """The finite numbers of a record as `prefix + key` (nested mappings as `prefix + key/inner`; booleans as 0/1):
    what TensorBoard and W&B chart, so both show the same values."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in skip:
            continue
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{prefix}{key}/", ()))
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[f"{prefix}{key}"] = float(value)
    return out


class MetricsSink(Protocol):
    """Somewhere else the logger's records go (`WandbSink`): scalars already flattened and prefixed."""

    def step(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def evaluation(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def event(self, record: Mapping[str, Any]) -> None: ...

    def summary(self, values: Mapping[str, Any]) -> None: ...

    def close(self, plot_path: str | None = None) -> None: ...


class MetricsLogger:
    """One record per step (and per evaluation or event) to `run_dir/metrics.jsonl`, TensorBoard, a bar and any
    `sinks`. `plot_path`: where `close()` draws the PNG curves (and hands them to the sinks); None draws none."""

    def __init__(self, run_dir: str | None, total_steps: int, *, start_step: int = 0, progress: bool = True,
                 sinks: Sequence[MetricsSink] = (), plot_path: str | None = None):
        if jax.process_index() != 0:  # multi-host: one process writes logs and draws the bar
            run_dir, progress, sinks, plot_path = None, False, (), None
        self.run_dir = run_dir
        self.records: list[dict[str, Any]] = []
        self.sinks = list(sinks)
        self.plot_path = plot_path
        self._file = None
        self._tb = None
        if run_dir:
            os.makedirs(run_dir, exist_ok=True)
            self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
            self._tb = _tensorboard_writer(os.path.join(run_dir, "tensorboard"))
        self._bar = None
        if progress:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total_steps, initial=start_step, desc="distill", dynamic_ncols=True)

    def _write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def _chart(self, step: int, values: dict[str, float], kind: str) -> None:
        if self._tb:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, step)
        for sink in self.sinks:
            getattr(sink, kind)(step, values)

    def step(self, record: dict[str, Any]) -> None:
        self._write(record)
        self._chart(record["step"], scalars(record, "train/"), "step")
        if self._bar:
            self._bar.update(1)
            self._bar.set_postfix({k: f"{record[k]:.4g}" for k in ("loss", "kl", "student_ce", "tokens_per_s")
                                   if k in record}, refresh=False)

    def evaluation(self, record: dict[str, Any]) -> None:
        self._write(record)
        self._chart(record["step"], scalars(record, "eval/"), "evaluation")
        self.message(f"eval @ step {record['step']}: " + ", ".join(
            f"{k} {record[k]:.4g}" for k in ("loss", "student_ce", "perplexity", "kl") if k in record))

    def rewind(self, step: int) -> None:
        if self._bar:
            self._bar.n = step
            self._bar.refresh()

    def message(self, text: str, *, event: str | None = None, **fields: Any) -> None:
        """A clear line on the terminal (above the bar) and in the log; `event` also records it in the JSONL
        and the sinks."""
        if self._bar:
            self._bar.write(text)
        if event in WARNING_EVENTS:
            log.warning(text)
        else:
            log.info(text)
        if event:
            record = {"event": event, "message": text, **fields}
            self._write(record)
            for sink in self.sinks:
                sink.event(record)

    def summary(self, values: Mapping[str, Any]) -> None:
        """The run's final values (targets met, last evaluation, ...) for the sinks' run summary."""
        for sink in self.sinks:
            sink.summary(values)

    def close(self) -> None:
        if self._bar:
            self._bar.close()
        plot = plot_history(self.records, self.plot_path) if self.plot_path else None
        for sink in self.sinks:
            sink.close(plot)
        if self._tb:
            self._tb.close()
        if self._file:
            self._file.close()


def config_values(config: Any) -> dict[str, Any]:
    """A configuration as JSON values with secret-looking entries redacted (`wandb_logger.redact_values`): its
    `to_dict()` (what `from_dict` reads back) when it has one and can write itself, else its fields (mappings as
    objects, anything JSON cannot write as its repr)."""
    try:
        values = config.to_dict()
    except (AttributeError, ValueError):  # no to_dict, or a stage holding an NNX filter rather than a pattern
        is_instance = dataclasses.is_dataclass(config) and not isinstance(config, type)
        values = dataclasses.asdict(config) if is_instance else dict(config)
    default = lambda value: dict(value) if isinstance(value, Mapping) else repr(value)  # noqa: E731
    return redact_values(json.loads(json.dumps(values, default=default)))


def make_logger(config: Any, run_dir: str | None = None, *, total_steps: int | None = None, start_step: int = 0,
                progress: bool | None = None, extra_config: Mapping[str, Any] | None = None) -> MetricsLogger:
    """The logger a run uses: JSONL, TensorBoard (when installed) and the bar, plus Weights & Biases when
    `config.logger == "wandb"` (project `config.wandb_project`). `run_dir`, `total_steps`, `progress` default to
    the config's; `extra_config` (e.g. the recipe's settings) joins the W&B config under "recipe". The PNG curves
    are drawn on `close()` when `config.plots` is set. Raises ValueError naming the `wandb` extra when W&B is
    asked for but not installed."""
    run_dir = config.run_dir if run_dir is None else run_dir
    kind = getattr(config, "logger", None)
    if kind not in (None, "wandb"):
        raise ValueError(f"logger={kind!r}: use 'wandb' or None (JSONL and TensorBoard are always written).")
    sinks: list[MetricsSink] = []
    if kind == "wandb" and jax.process_index() == 0:
        values = config_values(config)
        if extra_config:
            values["recipe"] = redact_values(json.loads(json.dumps(dict(extra_config), default=repr)))
        sinks.append(WandbSink.start(values, run_dir, project=getattr(config, "wandb_project", None),
                                     start_step=start_step))
    plot_path = os.path.join(run_dir, "curves.png") if run_dir and getattr(config, "plots", True) else None
    return MetricsLogger(run_dir, config.total_steps if total_steps is None else total_steps, start_step=start_step,
                         progress=config.progress if progress is None else progress, sinks=sinks,
                         plot_path=plot_path)


def plot_history(records: list[dict[str, Any]], path: str) -> str | None:
    """PNG curves of the loss terms, KL, cross-entropy / perplexity and throughput; None without step records."""
    steps = [r for r in records if "event" not in r and not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    if not steps:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = {k for r in steps for k in r}  # stages log different terms; the train step has no diagnostics
    divergences = ("kl", "term/kl", "term/reverse_kl", "term/jsd")
    panels: list[tuple[str, list[str]]]
    panels = [("losses", sorted(k for k in keys if k == "loss" or k.startswith("loss/"))),
              ("divergence", [k for k in divergences if k in keys]),
              ("cross-entropy", [k for k in ("student_ce", "teacher_ce") if k in keys]),
              ("throughput", [k for k in ("tokens_per_s",) if k in keys])]
    figure, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for axis, (title, panel_keys) in zip(axes, panels):
        for key in panel_keys:
            axis.plot([r["step"] for r in steps], [r.get(key, float("nan")) for r in steps], label=key)
        if title == "cross-entropy" and evals:
            axis.plot([r["step"] for r in evals], [r["student_ce"] for r in evals], "o-", label="eval student_ce")
        if title == "divergence" and any("kl" in r for r in evals):
            axis.plot([r["step"] for r in evals if "kl" in r], [r["kl"] for r in evals if "kl" in r], "o-",
                      label="eval kl")
        axis.set_title(title)
        axis.set_xlabel("step")
        if panel_keys:
            axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


__all__ = ["MetricsLogger", "MetricsSink", "make_logger", "config_values", "scalars", "plot_history", "step_flops", "matrix_parameters", "device_peak_flops",
           "attention_flops_per_token", "PEAK_BF16_FLOPS"]
