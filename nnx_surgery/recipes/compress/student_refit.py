"""--refit-rows: a cut student's narrowed MLPs refitted to its source's (`surgery.refit_mlp`) before it trains, in
the main run, in stage A and for each shape-search candidate alike; the control starts from the same weights."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from nnx_surgery import surgery
from nnx_surgery.surgery.storage.hf_checkpoint import gathered


@dataclasses.dataclass(frozen=True)
class Refit:
    report: surgery.RefitReport
    down: dict  # student layer -> its refitted down_proj weight (a host copy: training may donate the student's)


BATCH_TOKENS = 8192  # the most tokens a refit batch holds (while it has more than one row)


def batch_rows(seq_len: int) -> int:
    """Rows per batch of the refit's passes: 8, fewer for long rows, at least one. The products' temporaries grow
    with a batch's tokens: at 8 rows of 8,192 tokens, Gemma 7B's stage-A refit needs 44 GiB per chip of a v5e-8
    (`--aot`), at one row 10 GiB."""
    return max(1, min(8, BATCH_TOKENS // seq_len))


def refit_student(run, source, plan: surgery.Plan, student, data) -> Refit | None:
    """The narrowed MLPs of `student` (cut from `source` by `plan`) refitted on `--refit-rows` rows of `data` (in
    the student's tokens); None when the flag is 0 or no MLP was narrowed."""
    rows = run.config.surgery.refit_rows
    if not rows:
        return None
    report = surgery.refit_mlp(student, source, plan, data.calibration_ids(rows, seed=run.config.run.seed),
                               batch_size=batch_rows(run.config.data.seq_len))
    if not report.layers:
        return None
    print(f"[surgery] {report.summary()}", flush=True)
    return Refit(report, {s.layer: gathered(student.layers[s.layer].mlp.down_proj.weight[...])
                          for s in report.layers})


def restore(student, refit: Refit | None) -> None:
    """Give another cut of the same plan (the control's) the refitted weights."""
    for layer, down in (refit.down if refit else {}).items():
        weight = student.layers[layer].mlp.down_proj.weight
        weight.set_value(jax.device_put(jnp.asarray(down, weight[...].dtype), weight[...].sharding))
