"""The divergence guard's decisions and state: which step results are divergences, how many rollbacks a run has
had, and the learning-rate scale they left.

A step whose loss or gradient norm is not finite (the step itself then leaves the parameters unchanged) or whose
loss exceeds `spike_factor` x the running median of recent good steps is a divergence: the loop rolls back to the
last good state and the guard multiplies the learning rate by `lr_backoff`. After `max_rollbacks` the run stops
with DivergenceError; with the guard disabled a non-finite loss stops the run at once. It never continues on NaNs.
The state is part of every checkpoint's `meta` (`lr_scale`, `rollbacks`, `good_losses`), so a resumed run keeps
its backed-off learning rate and its spike history.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Mapping

from .fallbacks import DivergenceError


class DivergenceGuard:
    """The guard (`GuardConfig`) and its state: the losses of the last good steps (at most `window`), the
    rollbacks so far and the learning-rate scale."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.good_losses: list[float] = []
        self.rollbacks = 0
        self.lr_scale = 1.0

    def divergence(self, values: Mapping[str, float], step: int) -> str | None:
        """Why the step after `step` diverged, or None. With the guard disabled a non-finite loss raises."""
        guard, loss = self.settings, values["loss"]
        finite = math.isfinite(loss) and values.get("finite", 1.0) == 1.0
        if not guard.enabled:
            if not finite:
                raise DivergenceError(f"step {step + 1}: non-finite loss {loss} (the guard is disabled; "
                                      "parameters were left at their last finite values).")
            return None
        if not finite:
            return f"non-finite loss or gradient (loss {loss}, grad norm {values.get('grad_norm')})"
        if len(self.good_losses) >= guard.min_history:
            median = statistics.median(self.good_losses)
            if median > 0 and loss > guard.spike_factor * median:
                return f"loss {loss:.4g} exceeds {guard.spike_factor:g} x the running median {median:.4g}"
        return None

    def record(self, loss: float) -> None:
        """A good step's loss joins the running window."""
        self.good_losses = (self.good_losses + [loss])[-self.settings.window:]

    def restart_history(self) -> None:
        """Forget the window: the loss scale changed (a new stage, a fallback's weights)."""
        self.good_losses = []

    def count_rollback(self, failed_step: int, reason: str) -> None:
        """One more rollback; DivergenceError once there were more than `max_rollbacks`."""
        guard = self.settings
        self.rollbacks += 1
        if self.rollbacks > guard.max_rollbacks:
            raise DivergenceError(f"step {failed_step}: {reason}; giving up after {guard.max_rollbacks} rollbacks "
                                  f"(learning rate already scaled by {self.lr_scale:g}). Lower the learning rate, "
                                  "raise warmup, or check the data for corrupt batches.")

    def back_off(self) -> None:
        """After a rollback: the learning rate from now on is scaled by `lr_backoff` once more."""
        self.lr_scale *= self.settings.lr_backoff

    def state(self) -> dict[str, Any]:
        return {"lr_scale": self.lr_scale, "rollbacks": self.rollbacks, "good_losses": self.good_losses}

    def restore(self, meta: Mapping[str, Any]) -> None:
        self.lr_scale, self.rollbacks = float(meta["lr_scale"]), int(meta["rollbacks"])
        self.good_losses = [float(x) for x in meta["good_losses"]]


__all__ = ["DivergenceGuard", "DivergenceError"]
