"""What one compiled program needs on each device of an `--aot` target, and how fast the target would run it.

`measure(program, target, mfu)` compiles it (XLA's real compiler for the target) and returns a row: bytes per
device of the teacher's parameters, the student's (trainable and frozen), the optimizer state and the batch
(from the arguments' shardings), XLA's temporaries and outputs (those not aliased to donated arguments), the
total and the headroom in the target's memory; FLOPs per device from XLA beside the analytic count; and the
estimated step time: the larger of the compute bound (FLOPs at `mfu` of the published peak) and the memory
bound (XLA's bytes accessed over the published HBM bandwidth). XLA may count a loop's body once (the fused
logit loss walks the rows in `lax.map` loops), so the compute bound uses the larger of XLA's and the analytic
count, and the row says which. A compile that XLA refuses for memory (RESOURCE_EXHAUSTED) is itself the answer:
the row says "does not fit" with XLA's figures.
"""
from __future__ import annotations

import math
import re
import time
from typing import Any

import jax

from nnx_surgery.recipes.aot.targets import GIB, Target, out_of_memory

HEADROOM = 0.10  # the share of a device's memory a setting must leave free to be recommended


def device_bytes(tree: Any) -> int:
    """Bytes of `tree`'s ShapeDtypeStruct leaves held by one device (each leaf's shard under its sharding)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def leaf_parameter_count(tree: Any) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


# remat policies whose backward pass recomputes the student's matmuls ("dots" and "layers_dots" keep their outputs)
RECOMPUTES_MATMULS = ("full", "layers")


def analytic_flops(program) -> tuple[float, str]:
    """FLOPs per step over all devices: 6·N_student + 2·N_teacher per token for a train step (8·N_student with a
    remat that recomputes the forward's matmuls; 2·N for a forward of each model for the evaluation and the
    calibration forward), and the formula. Attention's T² work is not counted."""
    n_teacher = leaf_parameter_count(program.parts.get("teacher"))
    n_student = leaf_parameter_count(program.parts.get("student")) + leaf_parameter_count(program.parts.get("frozen"))
    if "optimizer" in program.parts:
        if program.remat in RECOMPUTES_MATMULS:  # the student's forward runs twice
            return (8 * n_student + 2 * n_teacher) * program.tokens, "8·N_student + 2·N_teacher per token (remat)"
        return (6 * n_student + 2 * n_teacher) * program.tokens, "6·N_student + 2·N_teacher per token"
    return 2 * (n_student + n_teacher) * program.tokens, "2·N per token (forward)"


def measure(program, target: Target, mfu: float) -> dict:
    """Compile `program` for `target` and account for its memory and time per device (module docstring)."""
    row = {"program": program.name, "tokens_per_step": program.tokens,
           "bytes": {"teacher_parameters": device_bytes(program.parts.get("teacher")),
                     "student_parameters": sum(device_bytes(program.parts.get(key))
                                               for key in ("student", "frozen", "projections")),
                     "optimizer_state": device_bytes(program.parts.get("optimizer")),
                     "batch": device_bytes(program.parts.get("batch"))},
           "memory_per_device": target.memory_per_device}
    started = time.perf_counter()
    try:
        compiled = program.lower().compile()
    except Exception as error:  # XLA's refusal for memory is an answer; anything else is a bug
        refusal = out_of_memory(error)
        if refusal is None:
            raise
        row.update(fits=False, compile_s=round(time.perf_counter() - started, 1), out_of_memory=refusal)
        return row
    row["compile_s"] = round(time.perf_counter() - started, 1)
    memory = compiled.memory_analysis()
    outputs = memory.output_size_in_bytes - memory.alias_size_in_bytes
    total = memory.argument_size_in_bytes + memory.temp_size_in_bytes + outputs + memory.generated_code_size_in_bytes
    row["bytes"].update(arguments=memory.argument_size_in_bytes, temporaries=memory.temp_size_in_bytes,
                        outputs=outputs, code=memory.generated_code_size_in_bytes, total=total)
    row.update(fits=total <= target.memory_per_device, headroom=1 - total / target.memory_per_device)
    row.update(speed(program, target, compiled, mfu))
    return row


def _cost(compiled) -> dict:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return dict(cost or {})


def speed(program, target: Target, compiled, mfu: float) -> dict:
    """FLOPs per device (XLA's and the analytic count), and the step time and tokens/s they imply on the target."""
    cost = _cost(compiled)
    devices = len(target.devices)
    xla = float(cost.get("flops", 0.0))
    analytic, formula = analytic_flops(program)
    per_device = analytic / devices
    used = "xla" if xla >= per_device else "analytic"
    row = {"flops_per_device_xla": xla, "flops_per_device_analytic": per_device, "flops_formula": formula,
           "flops_used": used, "bytes_accessed_per_device": float(cost.get("bytes accessed", 0.0))}
    if target.peak_flops_per_device is None:
        return row
    compute = max(xla, per_device) / (target.peak_flops_per_device * mfu)
    memory = row["bytes_accessed_per_device"] / target.bandwidth_per_device
    step = max(compute, memory)
    row.update(step_s_compute=compute, step_s_memory=memory, step_s=step, bound="compute" if compute >= memory
               else "memory", tokens_per_s=program.tokens / step if step else None)
    return row


def days_to(tokens: float, row: dict) -> float | None:
    rate = row.get("tokens_per_s")
    return tokens / rate / 86400 if rate else None


def format_table(rows: list[dict], target: Target, mfu: float, budget: float | None) -> str:
    """The rows as two tables (memory per device in GiB; compute and time), and the figures they rest on."""
    largest = max([row["bytes"].get("total") or 0 for row in rows] + [1])
    unit, scale = ("GiB", GIB) if largest >= GIB / 4 else ("MiB", 2 ** 20)

    def gib(value):
        return "" if value is None else f"{value / scale:.2f}"

    head = ["program", "teacher", "student", "Adam", "batch", "temps", "outputs", "total", "of", "headroom", "fits"]
    lines = [f"memory per device ({unit}) on {target.describe()}:", "  " + _row(head)]
    for row in rows:
        b = row["bytes"]
        oom = row.get("out_of_memory")
        total = b.get("total") if oom is None else oom.get("needed")
        fits = "yes" if row["fits"] else ("no: XLA needs more than it has" if oom and "needed" in oom else
                                          f"no: {oom['message'][:70]}" if oom else "no")
        lines.append("  " + _row([row["program"], gib(b["teacher_parameters"]), gib(b["student_parameters"]),
                                  gib(b["optimizer_state"]), gib(b["batch"]), gib(b.get("temporaries")),
                                  gib(b.get("outputs")), gib(total), gib(row["memory_per_device"]),
                                  f"{row['headroom']:.0%}" if "headroom" in row else "", fits]))
    lines += ["", f"compute per device (TFLOP per step; estimate at {mfu:.0%} of the peak bf16 FLOP/s, or the HBM "
              "bandwidth bound when slower):",
              "  " + _row(["program", "tokens", "XLA", "analytic", "used", "step s", "bound", "tokens/s",
                           "days" if budget else ""])]
    for row in rows:
        if "flops_per_device_xla" not in row:
            continue
        days = days_to(budget, row) if budget and row.get("train") else None
        lines.append("  " + _row([row["program"], f"{row['tokens_per_step']:,}",
                                  f"{row['flops_per_device_xla'] / 1e12:.3g}",
                                  f"{row['flops_per_device_analytic'] / 1e12:.3g}", row["flops_used"],
                                  f"{row['step_s']:.3f}" if "step_s" in row else "",
                                  row.get("bound", ""), f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s")
                                  else "", f"{days:.1f}" if days else ""]))
    if target.chip is not None:
        chip = target.chip
        lines.append(f"  {chip.name}: {chip.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16, {chip.hbm_bandwidth / 1e9:,.0f} "
                     f"GB/s, {chip.hbm_bytes / GIB:.0f} GiB per chip ({chip.source})"
                     + (f"; {target.cores_per_chip} devices per chip" if target.cores_per_chip > 1 else ""))
    return "\n".join(lines)


def _row(cells: list) -> str:
    widths = [26] + [8] * (len(cells) - 2) + [0]
    return " ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))


__all__ = ["measure", "format_table", "device_bytes", "leaf_parameter_count", "analytic_flops",
           "days_to", "HEADROOM"]
