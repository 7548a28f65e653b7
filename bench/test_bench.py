"""Fast checks of the benchmark tooling (not timings): `python -m pytest -q bench/test_bench.py` (~20 s).

The synthetic checkpoints load in transformers and in our loader with the same values, the FLOP count matches
the peer study's, the report renders and the GPU script runs at tiny shapes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

import common  # noqa: E402
from flops import step_flops  # noqa: E402
from make_checkpoint import make_checkpoint, shape_config  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for shape, extra in (("tiny-gemma", {"dtype": "float32"}), ("tiny-gemma2", {}), ("tiny-gemma3", {})):
        out[shape] = make_checkpoint(shape, str(root / shape), max_shard_size="200KB", **extra)["dir"]
    return out


def test_synthetic_checkpoint_matches_transformers(checkpoints):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from surgery.checkpoint import load_pretrained

    folder = checkpoints["tiny-gemma2"]
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))  # sharded like the Hub
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ours = load_pretrained(folder)
    gate = hf.model.layers[1].mlp.gate_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(ours.layers[1].mlp.gate_proj.weight[...], np.float32), gate)
    magnitude = np.abs(gate)
    assert 0.0078 <= magnitude.min() and magnitude.max() < 0.0313  # the documented value range


def test_flops_match_peer_study():
    teacher = shape_config("gemma-3-270m").to_hf_dict()
    student = dict(teacher, num_hidden_layers=9)
    assert step_flops(teacher, student, 2, 128) / 1e9 == pytest.approx(477.98, abs=0.01)


def test_report_renders_partial_results(tmp_path):
    import report

    path = tmp_path / "results.jsonl"
    path.write_text(json.dumps({"bench": "environment", "machine": common.machine(), "versions": {}}) + "\n")
    text = report.render(report.read_records([str(path)]))
    assert text.startswith("# Benchmarks") and "Not measured yet" in text


def test_gpu_script_runs_on_cpu_at_tiny_shapes(tmp_path):
    """bench/gpu.sh is the prepared H200 check; without a GPU it runs the same code at tiny shapes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHON": sys.executable, "BENCH_OUT": str(tmp_path / "out"),
           "BENCH_GPU_ROOT": str(tmp_path / "ckpt"), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(["bash", os.path.join(root, "bench", "gpu.sh")], capture_output=True, text=True,
                          env=env, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "gpu.jsonl").read_text().splitlines() if line]
    assert records, "gpu.sh wrote no measurement"
    ours = [r for r in records if r.get("event") == "distill" and r.get("peer") == "ours"]
    assert len(ours) == 2 and all(r["mfu"] > 0 and r["tokens_per_s"] > 0 for r in ours), ours  # both sweep points
    assert [r["batch"] for r in ours] == [2, 4] and ours[1]["remat"] == "dots"
    loads = [r for r in records if r.get("event") == "load"]
    assert {r["cache"] for r in loads} == {"cold", "warm"} and all(r["gb_per_s"] > 0 for r in loads), loads
    parts = [r for r in records if r.get("event") == "parts"]
    assert parts and all(parts[0][f"{name}_seconds"] > 0 for name in
                         ("teacher_forward", "student_trunk", "logit_loss", "adamw", "matmul_peak")), parts
    torch_runs = [r for r in records if r.get("event") == "distill" and r.get("peer") == "torch"]
    fastest = max(ours, key=lambda r: r["tokens_per_s"])  # the peer and the parts run at our fastest point
    assert torch_runs and torch_runs[0]["batch"] == fastest["batch"] and torch_runs[0]["tokens_per_s"] > 0, torch_runs
    assert parts[0]["batch"] == fastest["batch"] and parts[0]["chunk"] == fastest["logit_chunk"], parts
