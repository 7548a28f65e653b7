"""`--aot-search`: the settings that fit the target, found by compiling the fewest candidates.

The candidates keep the tokens per optimizer step and vary what changes memory: the mesh's split of the chips
(fsdp x tp), the micro-batch (with gradient accumulation making up the step), the remat policy, and the logit
loss's implementation (the two-pass loss, `distill.losses.two_pass`, where the run's loss is one it computes).
They are ordered by an estimated cost relative to the asked settings (remat's recomputation, more micro-batches,
tensor parallel traffic, the logits made twice), and compiled in that order on the program that needed the most memory, until one fits with
`aot_report.HEADROOM` free: the first that does is the fastest estimate that fits. At most `MAX_COMPILES` compiles.
"""
from __future__ import annotations

import dataclasses
import math

from nnx_surgery import distill
from nnx_surgery.distill.mesh import MeshError, format_mesh_spec
from nnx_surgery.recipes.aot import programs as aot_programs
from nnx_surgery.recipes.aot.report import HEADROOM, measure
from nnx_surgery.recipes.aot.targets import GIB, KNOWN_TOPOLOGIES, Target
from nnx_surgery.refusals import RecipeError
from nnx_surgery.recipes.compress import resolution
from nnx_surgery.recipes.config.sections import RecipeConfig

MAX_COMPILES = 6
# relative step cost of the remat policies the search tries: each decoder layer's forward recomputed in the backward
# pass, its matmul outputs kept (layers_dots) or nothing kept (layers). The whole-forward policies ("dots", "full")
# are not tried: one checkpoint around the whole forward leaves the backward pass holding every layer's activations,
# so they lower the peak little (tests/surgery/modeling/test_layer_remat.py) for the same recomputation.
REMAT_COST = {None: 1.0, "layers_dots": 1.1, "layers": 1.33}
# relative step cost of the logit loss's implementations: the two-pass loss makes both models' logits twice, about
# 1.5x the loss's matmuls, which are a tenth to a fifth of a distillation step's FLOPs at a 256k vocabulary
LOGIT_IMPL_COST = {"fused": 1.0, "two_pass": 1.1}


@dataclasses.dataclass(frozen=True)
class SettingsCandidate:
    mesh: dict
    batch_size: int
    grad_accum: int
    remat: str | None
    logit_impl: str = "fused"

    @property
    def cost(self) -> float:
        tp = self.mesh.get("tp", 1)
        return (REMAT_COST[self.remat] * LOGIT_IMPL_COST.get(self.logit_impl, 1.0)
                * (1 + 0.03 * math.log2(self.grad_accum)) * (1 + 0.1 * math.log2(tp)))

    def flags_text(self) -> str:
        return (f"--mesh {format_mesh_spec(self.mesh)} --batch-size {self.batch_size} --grad-accum "
                f"{self.grad_accum} --remat {self.remat or 'none'}"
                + (f" --set logit_impl={self.logit_impl}" if self.logit_impl != "fused" else ""))

    def apply(self, config: RecipeConfig) -> RecipeConfig:
        return resolution.replaced(config, training={"mesh": format_mesh_spec(self.mesh)},
                                   data={"batch_size": self.batch_size},
                                   distill={"grad_accum": self.grad_accum, "remat": self.remat,
                                            "logit_impl": self.logit_impl})


def remat_policies() -> list[str | None]:
    """The remat policies the search tries, those the trainer accepts (REMAT_COST's, cheapest first)."""
    accepted = []
    for policy in REMAT_COST:
        try:
            distill.DistillConfig(stages=(distill.Stage(steps=1),), remat=policy)
            accepted.append(policy)
        except ValueError:
            continue
    return accepted


def logit_impls(config: RecipeConfig) -> list[str]:
    """The logit loss implementations the search tries: the asked one, and the two-pass loss when the run asks
    for the fused one and the trainer accepts the two-pass loss for the run's loss (DistillConfig's own check)."""
    section = config.distill
    asked = section.logit_impl
    if asked != "fused":
        return [asked]
    weights = distill.LossWeights({"kl": 0.0, config.training.loss: 1.0})
    try:
        distill.DistillConfig(stages=(distill.Stage(steps=1, weights=weights),), logit_impl="two_pass",
                              top_k=section.top_k, train_diagnostics=section.train_diagnostics,
                              teacher_cache=section.teacher_cache)
    except ValueError:
        return [asked]
    return [asked, "two_pass"]


def candidates(config: RecipeConfig, devices: int) -> list[SettingsCandidate]:
    """Every split of the devices into fsdp x tp, micro-batch (a divisor of the step's rows the data axis splits),
    remat policy and logit loss implementation, cheapest estimate first."""
    rows = config.data.batch_size * config.distill.grad_accum
    found = []
    for tp in (d for d in range(1, devices + 1) if devices % d == 0 and d <= 8):
        fsdp = devices // tp
        mesh = {"fsdp": fsdp, "tp": tp} if tp > 1 else {"fsdp": fsdp}
        for micro in (b for b in range(rows, 0, -1) if rows % b == 0 and b % fsdp == 0):
            for remat in remat_policies():
                for impl in logit_impls(config):
                    found.append(SettingsCandidate(mesh, micro, rows // micro, remat, impl))
    return sorted(found, key=lambda c: (c.cost, -c.batch_size))


def search_fitting_settings(config: RecipeConfig, target: Target, program_name: str, mfu: float, asked: dict) -> dict:
    """The first candidate (cheapest estimate first) whose `program_name` fits with HEADROOM free, or why none
    does. `asked`: the asked settings' row of that program."""
    tried = []
    for candidate in candidates(config, len(target.devices)):
        if len(tried) >= MAX_COMPILES:
            break
        if _same(candidate, config):
            continue
        try:
            run = aot_programs.aot_run(candidate.apply(config))
            entries = {e.name: e for e in aot_programs.run_programs(run, target)}
            row = measure(entries[program_name].build(), target, mfu)
        except (MeshError, RecipeError, KeyError):  # a split the model's dimensions refuse
            continue
        row["flags"] = candidate.flags_text()
        tried.append(row)
        print(f"[aot search] {candidate.flags_text()}: {_verdict(row)}", flush=True)
        if row["fits"] and row.get("headroom", 0) >= HEADROOM:
            return {"program": program_name, "tried": tried, "best": row, "flags": candidate.flags_text()}
    return {"program": program_name, "tried": tried, "best": None, "why": why_nothing_fits(asked, target, config)}


def _same(candidate: SettingsCandidate, config: RecipeConfig) -> bool:
    return (candidate.batch_size, candidate.grad_accum, candidate.remat, candidate.logit_impl) == \
        (config.data.batch_size, config.distill.grad_accum, config.distill.remat, config.distill.logit_impl) and \
        format_mesh_spec(candidate.mesh) == (config.training.mesh or "")


def _verdict(row: dict) -> str:
    oom = row.get("out_of_memory")
    if oom:
        figures = f"XLA needs {oom['needed'] / GIB:.2f} of {oom['available'] / GIB:.2f} GiB" if "needed" in oom \
            else oom["message"][:100]
        return f"does not fit ({figures})"
    return f"{row['bytes']['total'] / GIB:.2f} GiB per device, {row['headroom']:.0%} free"


def why_nothing_fits(row: dict, target: Target, config: RecipeConfig) -> str:
    """One line: what takes most of a device's memory in the asked settings, and what would fit."""
    b = row["bytes"]
    state = b["student_parameters"] + b["optimizer_state"]
    activations = b.get("temporaries") or (row.get("out_of_memory", {}).get("needed") or 0)
    parts = {"the student's weights and Adam state": state, "the teacher's weights": b["teacher_parameters"],
             "the activations" + (" and attention maps captured for transfer" if config.training.term_weights.get(
                 "attention") else ""): activations}
    dominant = max(parts, key=lambda name: parts[name])
    persistent = state + b["teacher_parameters"]
    chips = math.ceil(persistent * len(target.devices) / ((1 - HEADROOM) * target.memory_per_device) * 1.5)
    larger = [name for name in KNOWN_TOPOLOGIES if name.startswith(target.name.partition(":")[0] + ":")
              and math.prod(int(x) for x in name.partition(":")[2].split("x")) >= chips]
    hint = f"a slice of {chips}+ chips ({larger[0]})" if larger and target.chip else "more devices"
    if "attention" in dominant:
        hint += ", or fewer layers captured for attention transfer (--attention-weight 0 drops them)"
    return (f"nothing tried fits with {HEADROOM:.0%} free: {dominant} take most of a device "
            f"({parts[dominant] / GIB:.2f} GiB of {target.memory_per_device / GIB:.2f}); try {hint}.")


__all__ = ["SettingsCandidate", "candidates", "logit_impls", "search_fitting_settings", "remat_policies",
           "why_nothing_fits", "MAX_COMPILES"]
