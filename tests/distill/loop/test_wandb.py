"""Weights & Biases logging, offline: `metrics.make_logger` with `logger="wandb"` writes a W&B run folder whose
history, config and summary hold what the JSONL and TensorBoard hold; a resumed run continues the same W&B run;
no token reaches any file; a missing `wandb` package is a clear error. Never the network, never an API key
(WANDB_MODE=offline, every W&B folder under tmp_path)."""
import glob
import importlib.util
import json
import os
import re
import struct
import sys

import pytest

from nnx_surgery.distill.loop.run_config import DistillConfig, LossWeights, Stage
from nnx_surgery.distill.loop.metrics import make_logger
from nnx_surgery.distill.loop.wandb_logger import RUN_ID_FILE, redact_values

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="the wandb extra is not installed (pip install 'nnx-surgery[wandb]')")
needs_tensorboard = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("tensorboard", "tensorboardX")),
    reason="the tensorboard extra is not installed (pip install 'nnx-surgery[tensorboard]')")
SECRET = "hf_" + "Zq8" * 12  # shaped like a Hugging Face token; must appear in no file


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for name, folder in (("WANDB_DIR", "wandb_home"), ("WANDB_CONFIG_DIR", "wandb_config"),
                         ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_DATA_DIR", "wandb_data")):
        monkeypatch.setenv(name, str(tmp_path / folder))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    for name in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def read_run(folder: str) -> list:
    """The protobuf records of an offline run's `run-<id>.wandb` file (a LevelDB-style log: a 7-byte header, then
    32 KiB blocks of records, each a 7-byte header (crc32, length, type) and a payload; a record that does not fit
    in a block continues in the next as FIRST / MIDDLE / LAST pieces)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(folder, "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, position, pending, block = [], 7, b"", 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is zero padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(records) -> list[dict]:
    rows = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    return [{"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in row.item} for row in rows]


def run_config(records) -> dict:
    config = {}
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else ()
        config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates})
    return config


def summary(records) -> dict:
    values = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            values.update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in record.summary.update})
    return values


def tensorboard_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(folder)
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def config(run_dir, **changes) -> DistillConfig:
    stage = Stage(steps=3, learning_rate=1e-3, weights=LossWeights(kl=1.0, feature=0.5))
    settings = dict(stages=(stage,), logger="wandb", wandb_project="nnx-test", run_dir=str(run_dir), progress=False)
    return DistillConfig(**{**settings, **changes})


def log_a_run(logger, steps=(1, 2, 3)) -> None:
    for step in steps:
        logger.step({"step": step, "stage": 0, "loss": 2.0 / step, "loss/logit": 1.5 / step, "kl": 0.5 / step,
                     "student_ce": 3.0 - 0.1 * step, "tokens_per_s": 1000.0 + step, "warmup": step == 1,
                     "grad_norm": float("nan") if step == 2 else 1.0})
        if step == 2:
            logger.message("loss spiked: rolled back to step 1", event="rollback", step=2, failed_step=2,
                           lr_scale=0.5)
    logger.evaluation({"step": steps[-1], "eval": True, "loss": 0.4, "kl": 0.4, "student_ce": 2.5,
                       "perplexity": 12.2, "targets": {"kl": False, "correlation": True}})
    logger.summary({"targets_met": {"kl": False, "correlation": True}, "final_kl": 0.4})


def offline_runs(home) -> list[str]:
    return sorted(glob.glob(os.path.join(str(home), "wandb_home", "wandb", "offline-run-*")))


@needs_wandb
@needs_tensorboard
def test_offline_run_holds_the_same_metrics_events_config_summary_and_curves(offline):
    run_dir = offline / "run"
    logger = make_logger(config(run_dir), extra_config={"teacher": "google/gemma-7b", "hub_token": SECRET})
    log_a_run(logger)
    logger.close()

    (folder,) = offline_runs(offline)
    run_id = json.load(open(run_dir / RUN_ID_FILE))["id"]
    assert folder.endswith("-" + run_id)
    records = read_run(folder)
    rows = history(records)
    train = [r for r in rows if "train/loss" in r]
    assert [(r["step"], r["train/loss"]) for r in train] == [(1, 2.0), (2, 1.0), (3, 2.0 / 3)]
    assert [r.get("train/grad_norm") for r in train] == [1.0, None, 1.0]  # non-finite values are not charted
    assert train[0]["train/warmup"] == 1.0 and "train/warmup" in train[1] and train[1]["train/warmup"] == 0.0
    (event,) = [r for r in rows if "event/rollback" in r]
    assert event["step"] == 2
    (evaluation,) = [r for r in rows if "eval/kl" in r]
    assert evaluation["step"] == 3 and evaluation["eval/perplexity"] == 12.2
    assert evaluation["eval/targets/kl"] == 0.0 and evaluation["eval/targets/correlation"] == 1.0

    # TensorBoard and the JSONL hold the same values
    board = tensorboard_scalars(str(run_dir / "tensorboard"))
    for row in train + [evaluation]:
        for key, value in row.items():
            if key.startswith(("train/", "eval/")):
                assert (row["step"], pytest.approx(value)) in board[key], key
    assert sum(len(points) for points in board.values()) == sum(
        len([k for k in row if k.startswith(("train/", "eval/"))]) for row in train + [evaluation])
    lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [line["loss"] for line in lines if "loss" in line and not line.get("eval")] == [2.0, 1.0, 2.0 / 3]

    values = run_config(records)
    assert values["wandb_project"] == "nnx-test" and values["logger"] == "wandb"
    assert values["stages"][0]["weights"] == {"kl": 1.0, "feature": 0.5}
    assert values["recipe"] == {"teacher": "google/gemma-7b", "hub_token": "<redacted>"}
    final = summary(records)
    assert final["targets_met"] == {"kl": False, "correlation": True} and final["final_kl"] == 0.4
    assert final["eval/kl"] == 0.4 and final["train/loss"] == pytest.approx(2.0 / 3)

    # the curves (also run_dir/curves.png) as an image, the events as a table
    assert os.path.getsize(run_dir / "curves.png") > 1000
    (image,) = glob.glob(os.path.join(folder, "files", "media", "images", "curves_*.png"))
    assert open(image, "rb").read() == open(run_dir / "curves.png", "rb").read()
    (table,) = glob.glob(os.path.join(folder, "files", "media", "table", "events_*.table.json"))
    table = json.load(open(table))
    assert table["columns"] == ["step", "event", "message", "details"]
    assert table["data"][0][:3] == [2, "rollback", "loss spiked: rolled back to step 1"]
    assert json.loads(table["data"][0][3]) == {"failed_step": 2, "lr_scale": 0.5}

    written = [os.path.join(root, name) for root, _, names in os.walk(offline) for name in names]
    assert len(written) > 10  # the run folder, its logs and media, the JSONL, TensorBoard, curves, the run id
    for path in written:
        assert SECRET.encode() not in open(path, "rb").read(), path


@needs_wandb
def test_resumed_run_continues_the_same_wandb_run(offline):
    run_dir = offline / "run"
    first = make_logger(config(run_dir))
    log_a_run(first, steps=(1, 2))
    first.close()
    run_id = json.load(open(run_dir / RUN_ID_FILE))["id"]
    resumed = make_logger(config(run_dir), start_step=2)
    log_a_run(resumed, steps=(3,))
    resumed.close()
    folders = offline_runs(offline)
    # offline-run-<time>-<id>, with "-1" appended by wandb when both runs start within the same second
    assert len(folders) == 2 and all(re.search(rf"-{run_id}(-\d+)?$", folder) for folder in folders)
    assert [r["step"] for r in history(read_run(folders[1])) if "train/loss" in r] == [3]
    fresh = make_logger(config(run_dir))  # a new run in the same folder: a new W&B run
    fresh.close()
    assert json.load(open(run_dir / RUN_ID_FILE))["id"] != run_id


def test_no_wandb_run_without_the_logger_setting(offline):
    logger = make_logger(config(offline / "run", logger=None, plots=False))
    log_a_run(logger)
    logger.close()
    assert not logger.sinks and offline_runs(offline) == [] and not os.path.exists(offline / "run" / RUN_ID_FILE)
    assert not os.path.exists(offline / "run" / "curves.png")


def test_missing_wandb_names_the_extra(offline, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if the package were not installed
    with pytest.raises(ValueError, match=r"pip install 'nnx-surgery\[wandb\]'"):
        make_logger(config(offline / "run"))


def test_redact_hides_secret_keys_and_token_shaped_values():
    values = {"hub_token": "abc", "api_key": "k", "password": "p", "max_tokens": 5, "push_to_hub": "me/model",
              "note": SECRET, "nested": [{"WANDB_API_KEY": "x"}, "d" * 40], "revision": "a" * 40, "token": None, "eos_token": "<eos>"}
    assert redact_values(values) == {"hub_token": "<redacted>", "api_key": "<redacted>", "password": "<redacted>",
                              "max_tokens": 5, "push_to_hub": "me/model", "note": "<redacted>",
                              "nested": [{"WANDB_API_KEY": "<redacted>"}, "<redacted>"], "revision": "a" * 40,
                              "token": None, "eos_token": "<eos>"}


@needs_wandb
def test_a_training_run_logs_its_steps_evaluations_events_and_curves_to_wandb(offline):
    """`distill.loop.trainer.run` with logger="wandb": W&B's history holds the run's own step and evaluation values."""
    from nnx_surgery.distill.loop.trainer import run
    from distill_fixtures import BATCH, FAST_COMPILE, LENGTH, ArrayBatches, student_from, teacher_samples, \
        tiny_teacher

    teacher = tiny_teacher()
    batches = teacher_samples(teacher, 5, seed=1)
    settings = config(offline / "run", stages=(Stage(steps=3, learning_rate=1e-2),), batch_size=BATCH,
                      seq_len=LENGTH, logit_chunk=16, eval_every=2, compiler_options=FAST_COMPILE)
    result = run(teacher, student_from(teacher), ArrayBatches(batches[:4]), settings, eval_data=batches[4:])
    (folder,) = offline_runs(offline)
    records = read_run(folder)
    rows = history(records)
    assert [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r] == [
        (h["step"], pytest.approx(h["loss"])) for h in result.history]
    assert [(r["step"], r["eval/kl"]) for r in rows if "eval/kl" in r] == [
        (e["step"], pytest.approx(e["kl"])) for e in result.evals]
    assert [r["step"] for r in rows if "event/stage" in r] == [0]
    assert run_config(records)["stages"][0]["learning_rate"] == 1e-2
    assert glob.glob(os.path.join(folder, "files", "media", "images", "curves_*.png"))
