"""Weights & Biases for a distillation run: the optional `wandb` extra (`pip install 'nnx-surgery[wandb]'`).

`WandbSink` receives what `metrics.MetricsLogger` writes to the JSONL and TensorBoard: step records as `train/*`,
evaluations as `eval/*`, each event as `event/<kind>` = 1 at its step plus one row of the `events` table, the
resolved configuration (the same values as `run_dir/config.json`) as the run's config, `summary()` values as its
summary, and the PNG curves as the `curves` image when the logger closes. Every history row carries `step`, the
x-axis of every chart (`define_metric`): a step redone after a rollback, or logged again after a resume, is
plotted at its own step, where W&B's internal counter would refuse it.

The run is named after `run_dir`, keeps its files there (unless WANDB_DIR says otherwise) and records its id in
`run_dir/wandb_run.json`, so a resumed training run continues the same W&B run. `WANDB_MODE=offline` writes the
run to disk only (`wandb sync` uploads it later). Credentials never reach W&B: configuration keys that name a
token, key, secret or password, and values shaped like Hugging Face or W&B tokens, are replaced by "<redacted>";
the console is not captured.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

WANDB_EXTRA = "pip install 'nnx-surgery[wandb]'"
RUN_ID_FILE = "wandb_run.json"
REDACTED = "<redacted>"
_SECRET_KEY = re.compile(r"(^|[_.-])(token|api_?key|secret|password|passwd|credentials?|auth)($|[_.-])", re.I)
_SECRET_VALUE = re.compile(r"^(hf_[A-Za-z0-9]{20,}|[0-9a-f]{40}|[A-Za-z0-9_-]{2,}-[0-9a-f]{40})$")
_REVISION_KEY = re.compile(r"revision|commit|sha|hash|fingerprint", re.I)
_SPECIAL_TOKEN_KEY = re.compile(r"^(bos|eos|pad|unk|sep|cls|mask)_token(_id)?$", re.I)  # a tokenizer's, no secret


def _secret_key(name: str) -> bool:
    return bool(_SECRET_KEY.search(name)) and not _SPECIAL_TOKEN_KEY.match(name)


def redact_values(values: Any, key: str = "") -> Any:
    """A copy of nested dicts / lists with secret-looking keys and token-shaped strings replaced by "<redacted>"
    (a 40-hex-digit string under a key naming a revision, commit or hash is kept: that is a git or Hub revision)."""
    if isinstance(values, Mapping):
        return {name: REDACTED if _secret_key(str(name)) and value not in (None, "", False)
                else redact_values(value, str(name)) for name, value in values.items()}
    if isinstance(values, (list, tuple)):
        return [redact_values(value, key) for value in values]
    if isinstance(values, str) and _SECRET_VALUE.match(values) and not _REVISION_KEY.search(key):
        return REDACTED
    return values


def import_wandb():
    """The `wandb` module, or a ValueError that says how to install it."""
    try:
        import wandb
    except ImportError:
        raise ValueError(f"logger='wandb' needs the Weights & Biases client: {WANDB_EXTRA} (or pip install wandb); "
                         "or leave DistillConfig.logger unset (metrics.jsonl and TensorBoard are always written)."
                         ) from None
    return wandb


def _saved_run_id(run_dir: str | None) -> str | None:
    path = os.path.join(run_dir, RUN_ID_FILE) if run_dir else None
    if not path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle).get("id")


class WandbSink:
    """One W&B run fed by a MetricsLogger (see the module docstring). Build it with `WandbSink.start`."""

    def __init__(self, run: Any, wandb: Any):
        self.run, self._wandb = run, wandb
        self.events: list[list[Any]] = []
        self.last_step = 0
        run.define_metric("step")
        run.define_metric("*", step_metric="step")

    @classmethod
    def start(cls, config_values: Mapping[str, Any], run_dir: str | None, *, project: str | None = None,
              start_step: int = 0, name: str | None = None) -> "WandbSink":
        """Open (or, when `start_step` > 0 and run_dir names an earlier W&B run, resume) the run."""
        wandb = import_wandb()
        run_id = _saved_run_id(run_dir) if start_step > 0 else None  # None: W&B draws a new id
        folder = os.environ.get("WANDB_DIR") or run_dir
        for path in {path for path in (folder, run_dir) if path is not None}:
            os.makedirs(path, exist_ok=True)
        project = project or os.environ.get("WANDB_PROJECT") or "nnx-surgery"
        try:
            run = wandb.init(project=project, id=run_id, resume="allow", dir=folder,
                             config=redact_values(config_values),
                             name=name or (os.path.basename(os.path.normpath(run_dir)) if run_dir else None),
                             settings=wandb.Settings(console="off", save_code=False, disable_code=True))
        except Exception as error:  # wandb's own errors (no login, no network) carry no hint of the fallbacks
            raise ValueError(f"Weights & Biases could not start a run ({type(error).__name__}: {error}); run "
                             "`wandb login`, or set WANDB_MODE=offline to write the run to disk and `wandb sync` "
                             "it later, or leave DistillConfig.logger unset.") from error
        if run_dir:
            with open(os.path.join(run_dir, RUN_ID_FILE), "w", encoding="utf-8") as handle:
                json.dump({"id": run.id, "project": project}, handle)
        return cls(run, wandb)

    def _log(self, step: int, values: Mapping[str, float]) -> None:
        self.last_step = max(self.last_step, int(step))
        self.run.log({"step": int(step), **values})

    def step(self, step: int, scalars: Mapping[str, float]) -> None:
        self._log(step, scalars)

    def evaluation(self, step: int, scalars: Mapping[str, float]) -> None:
        self._log(step, scalars)

    def event(self, record: Mapping[str, Any]) -> None:
        step = int(record.get("step", self.last_step))
        details = {k: v for k, v in record.items() if k not in ("step", "event", "message")}
        self.events.append([step, str(record["event"]), str(record.get("message", "")),
                            json.dumps(redact_values(details), default=repr)])
        self._log(step, {f"event/{record['event']}": 1})

    def summary(self, values: Mapping[str, Any]) -> None:
        self.run.summary.update(redact_values(dict(values)))

    def close(self, plot_path: str | None = None) -> None:
        extras: dict[str, Any] = {}
        if plot_path and os.path.isfile(plot_path):
            extras["curves"] = self._wandb.Image(plot_path)
        if self.events:
            extras["events"] = self._wandb.Table(columns=["step", "event", "message", "details"], data=self.events)
        if extras:
            self._log(self.last_step, extras)
        self.run.finish()


__all__ = ["WandbSink", "redact_values", "import_wandb", "WANDB_EXTRA", "RUN_ID_FILE"]
