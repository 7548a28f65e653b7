"""Fallbacks when distillation goes wrong, beyond the guard's rollback and learning-rate backoff (driver.py).

Selected and combined with `GuardConfig.policies`:

* `switch_to_mse`: after a divergence (once the guard has rolled back), the weights of the terms that name this
  policy in their `fallbacks` (the auxiliary MSE term of mse.py, on logits or mapped features as its `on`
  option says) are raised by `mse_weight` for `mse_steps` optimizer steps, then the stage's configured losses are
  back. A further divergence meanwhile restarts the window.
* `sft_then_mix`: when the held-out student cross-entropy is worse than at the start of the stage for
  `sft_patience` evaluations in a row, the run trains on pure cross-entropy for `sft_steps`, then ramps the
  distillation weight back linearly over `sft_ramp_steps` to `sft_alpha`, where it stays until the stage ends:
  weights = d * KD + (1 - d) * CE, KD being the stage's teacher-side weights with its logit divergences
  (kl / reverse_kl / jsd) scaled to sum to 1. It acts at most once per stage; the next stage starts with its own
  configured weights.

Both change only traced loss weights (the step compiles in the weights each policy moves, as the terms declare
in `LossTerm.fallbacks`: the MSE term, the logit term's CE kind), so no switch recompiles. Every switch is an
event with its reason; the state is part of every checkpoint's `meta`, so a run interrupted during a fallback
resumes inside it.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..losses import term_registry as terms

DIVERGENCES = ("kl", "reverse_kl", "jsd")
Event = tuple[str, dict[str, Any]]  # (message, fields)


class DivergenceError(RuntimeError):
    """The loss kept diverging after the configured number of rollbacks."""


def mixed_weights(weights: Mapping[str, float], distill_weight: float) -> dict[str, float]:
    """d * KD + (1 - d) * CE (module docstring): d = 0 is pure cross-entropy."""
    divergence = sum(weights[name] for name in DIVERGENCES if name in weights)
    scale = 1.0 / divergence if divergence > 0 else 1.0
    out = {name: 0.0 for name in weights}
    for name, value in weights.items():
        if name != "ce" and value:
            out[name] = distill_weight * value * (scale if name in DIVERGENCES else 1.0)
    out["ce"] = 1.0 - distill_weight
    return out


class Fallbacks:
    """The policies' state and the loss weights they make; the loop reports each returned event."""

    def __init__(self, guard: Any, has_teacher: bool, mse_on: str = "logits"):
        self.settings = guard  # a GuardConfig, validated when it was made
        self.mse_on = mse_on  # what the MSE term compares (its option `on`), for the events
        self.policies = guard.policies if guard.enabled else ()
        if self.policies and not has_teacher:
            raise ValueError(f"GuardConfig.policies {self.policies} fall back from distillation to other losses; "
                             "a run without a teacher has nothing to fall back from: drop them.")
        self.mse_until: int | None = None  # global step index the MSE stays on before
        self.sft: dict[str, Any] | None = None  # {"stage", "start"}: the stage and first step of the SFT fallback
        self.baseline: dict[str, Any] | None = None  # {"stage", "value", "worse"}: held-out CE at stage start
        self.sft_stages: list[int] = []  # stages where sft_then_mix has acted

    def uses(self, policy: str) -> bool:
        return policy in self.policies

    @property
    def moved_weights(self) -> tuple[str, ...]:
        """The weights a step record reports while a fallback is on: the cross-entropy mix of sft_then_mix and
        the weights switch_to_mse raises."""
        return ("kl", "ce", *terms.fallback_weights(("switch_to_mse",)))

    @property
    def active(self) -> bool:
        """Whether a fallback may be setting the weights (the loop then asks `weights`)."""
        return self.mse_until is not None or self.sft is not None

    # ---- the weights of a step ----------------------------------------------------------------------
    def distill_weight(self, step: int) -> float | None:
        """sft_then_mix's d at global step index `step` (None: not active)."""
        if self.sft is None:
            return None
        s = self.settings
        into = step - self.sft["start"]
        if into < s.sft_steps:
            return 0.0
        ramp = s.sft_ramp_steps
        return s.sft_alpha * (min(1.0, (into - s.sft_steps + 1) / ramp) if ramp else 1.0)

    def weights(self, weights: Mapping[str, float], step: int) -> tuple[dict[str, float], list[str]]:
        """The loss weights of global step index `step` and the active fallbacks' names."""
        out, active = dict(weights), []
        distill = self.distill_weight(step)
        if distill is not None:
            out, active = mixed_weights(weights, distill), ["sft_then_mix"]
        if self.mse_until is not None and step < self.mse_until:
            for name in terms.fallback_weights(("switch_to_mse",)):
                out[name] = out.get(name, 0.0) + self.settings.mse_weight
            active.append("switch_to_mse")
        return out, active

    # ---- decisions ----------------------------------------------------------------------------------
    def on_divergence(self, restored_step: int, reason: str) -> list[Event]:
        if not self.uses("switch_to_mse"):
            return []
        s = self.settings
        self.mse_until = restored_step + s.mse_steps
        return [(f"FALLBACK switch_to_mse: adding the {self.mse_on} MSE loss (weight {s.mse_weight:g}) for "
                 f"steps {restored_step + 1}-{self.mse_until} after a divergence ({reason}).",
                 {"policy": "switch_to_mse", "action": "start", "reason": f"divergence: {reason}",
                  "until_step": self.mse_until, "weight": s.mse_weight, "on": self.mse_on})]

    def on_step(self, step: int) -> list[Event]:
        """After global step `step` (1-based count of completed steps): phase ends."""
        events: list[Event] = []
        if self.mse_until is not None and step >= self.mse_until:
            self.mse_until = None
            events.append((f"FALLBACK switch_to_mse ends after step {step}: back to the configured losses.",
                           {"policy": "switch_to_mse", "action": "end",
                            "reason": f"{self.settings.mse_steps} steps done"}))
        if self.sft is not None:
            s, into = self.settings, step - self.sft["start"]
            if into == s.sft_steps and s.sft_ramp_steps:
                events.append((f"FALLBACK sft_then_mix: {s.sft_steps} steps of pure cross-entropy done; ramping "
                               f"the distillation weight to {s.sft_alpha:g} over {s.sft_ramp_steps} steps.",
                               {"policy": "sft_then_mix", "action": "ramp", "reason": "sft_steps done"}))
            if into == s.sft_steps + s.sft_ramp_steps:
                events.append((f"FALLBACK sft_then_mix: distillation weight back at {s.sft_alpha:g} (with "
                               f"{1 - s.sft_alpha:g} cross-entropy) for the rest of the stage.",
                               {"policy": "sft_then_mix", "action": "mixed", "reason": "ramp done"}))
        return events

    def on_stage(self, index: int, evaluation: Mapping[str, Any] | None = None) -> list[Event]:
        """Entering stage `index`: sft_then_mix ends with the stage it acted in; its baseline is `evaluation` (one
        made at this very step), else the next evaluation."""
        self.baseline = None
        if evaluation is not None and "student_ce" in evaluation:
            self.baseline = {"stage": index, "value": float(evaluation["student_ce"]), "worse": 0}
        if self.sft is None or self.sft["stage"] == index:
            return []
        self.sft = None
        return [(f"FALLBACK sft_then_mix ends with its stage: stage {index} starts with its configured losses.",
                 {"policy": "sft_then_mix", "action": "end", "reason": "stage ended"})]

    def on_evaluation(self, step: int, stage: int, record: Mapping[str, Any]) -> list[Event]:
        """Held-out student cross-entropy against the stage's start; may start sft_then_mix at step `step`."""
        if not self.uses("sft_then_mix") or "student_ce" not in record:
            return []
        value = float(record["student_ce"])
        if self.baseline is None or self.baseline["stage"] != stage:
            self.baseline = {"stage": stage, "value": value, "worse": 0}
            return []
        if self.sft is not None or stage in self.sft_stages:
            return []
        base = self.baseline
        base["worse"] = base["worse"] + 1 if value > base["value"] else 0
        if base["worse"] < self.settings.sft_patience:
            return []
        self.sft, s = {"stage": stage, "start": step}, self.settings
        self.sft_stages.append(stage)
        reason = (f"held-out student_ce {value:.4g} worse than {base['value']:.4g} at the stage's start for "
                  f"{base['worse']} evaluation(s)")
        return [(f"FALLBACK sft_then_mix: {reason}; training on pure cross-entropy for {s.sft_steps} steps, "
                 f"then ramping the distillation weight to {s.sft_alpha:g} over {s.sft_ramp_steps}.",
                 {"policy": "sft_then_mix", "action": "start", "reason": reason, "stage": stage,
                  "sft_steps": s.sft_steps, "ramp_steps": s.sft_ramp_steps, "alpha": s.sft_alpha})]

    # ---- checkpoints --------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"mse_until": self.mse_until, "sft": self.sft, "baseline": self.baseline,
                "sft_stages": list(self.sft_stages)}

    def restore(self, state: Mapping[str, Any] | None) -> None:
        state = state or {}
        self.mse_until = state.get("mse_until")
        self.sft = dict(state["sft"]) if state.get("sft") else None
        self.baseline = dict(state["baseline"]) if state.get("baseline") else None
        self.sft_stages = list(state.get("sft_stages", []))


__all__ = ["Fallbacks", "DivergenceError", "mixed_weights"]
