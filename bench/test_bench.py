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
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

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


@pytest.mark.slow
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
    # the first point's step compiled apart (what --aot reports), beside the device's peak where there is one
    assert "compiled_error" not in ours[0] and ours[0]["compiled_total_bytes"] > ours[0]["compiled_temp_bytes"] > 0
    assert "compiled_total_bytes" not in ours[1]
    loads = [r for r in records if r.get("event") == "load"]
    assert {r["cache"] for r in loads} == {"cold", "warm"} and all(r["gb_per_s"] > 0 for r in loads), loads
    parts = [r for r in records if r.get("event") == "parts"]
    assert parts and all(parts[0][f"{name}_seconds"] > 0 for name in
                         ("teacher_forward", "student_trunk", "logit_loss", "adamw", "head_gradients",
                                                      "head_gradients_f32_operands", "matmul_peak")), parts
    traces = [r for r in records if r.get("event") == "trace"]  # the fastest point, under jax.profiler
    assert len(traces) == 1 and "error" not in traces[0], traces
    assert traces[0]["busy_ms_per_step"] > 0 and traces[0]["top"] and os.path.getsize(traces[0]["file"]) > 0
    torch_runs = [r for r in records if r.get("event") == "distill" and r.get("peer") == "torch"]
    fastest = max(ours, key=lambda r: r["tokens_per_s"])  # the peer and the parts run at our fastest point
    assert torch_runs and torch_runs[0]["batch"] == fastest["batch"] and torch_runs[0]["tokens_per_s"] > 0, torch_runs
    assert parts[0]["batch"] == fastest["batch"] and parts[0]["chunk"] == fastest["logit_chunk"], parts


def test_hub_layout_copy_is_the_safetensors_librarys_and_loads_everywhere(checkpoints, tmp_path):
    """`copy_with_layout(.., "hub")` writes each file byte for byte as `safetensors.numpy.save_file` would (header
    padded to 8 bytes, tensors sorted), with data not 64-byte aligned; transformers and ours load the same values
    from it as from the aligned original, and rewriting it "aligned" gives our writer's layout back."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import ml_dtypes  # noqa: F401
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from make_checkpoint import copy_with_layout, data_start, ensure_layout, layout_of
    from nnx_surgery.surgery.storage.hf_checkpoint import load_pretrained

    folder = checkpoints["tiny-gemma2"]
    hub = ensure_layout(folder, str(tmp_path / "hub"), "hub")
    assert layout_of(folder) == "aligned" and layout_of(hub) == "hub"
    files = sorted(f for f in os.listdir(hub) if f.endswith(".safetensors"))
    assert len(files) > 1 and files == sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    for name in files:
        path = os.path.join(hub, name)
        assert data_start(path) % 64 != 0 and data_start(path) % 8 == 0
        with safe_open(path, "numpy") as f:
            metadata = f.metadata()
        save_file(load_file(path), str(tmp_path / "library.safetensors"), metadata=metadata)
        assert (tmp_path / "library.safetensors").read_bytes() == open(path, "rb").read(), name
    stamp = os.path.getmtime(os.path.join(hub, "config.json"))
    assert ensure_layout(folder, hub, "hub") == hub and os.path.getmtime(os.path.join(hub, "config.json")) == stamp

    aligned, from_hub = load_pretrained(folder), load_pretrained(hub)
    for (path, a), (_, b) in zip(nnx_leaves(aligned), nnx_leaves(from_hub)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hub, dtype=torch.bfloat16)
    np.testing.assert_array_equal(np.asarray(from_hub.layers[2].mlp.up_proj.weight[...], np.float32),
                                  hf.model.layers[2].mlp.up_proj.weight.detach().float().numpy())
    back = copy_with_layout(hub, str(tmp_path / "back"), "aligned")
    assert set(back["data_start_mod_64"].values()) == {0} and layout_of(back["dir"]) == "aligned"
    for (path, a), (_, b) in zip(nnx_leaves(aligned), nnx_leaves(load_pretrained(back["dir"]))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=str(path))


def nnx_leaves(model) -> list:
    from flax import nnx

    return [(path, v[...]) for path, v in nnx.to_flat_state(nnx.state(model))]


def test_report_renders_both_load_layouts():
    import report

    def summary(layout, cache, met):
        return {"bench": "load", "summary": True, "run": "r1", "cache": cache, "layout": layout,
                "checkpoint": "gemma-2-2b" + ("-hub" if layout == "hub" else ""), "checkpoint_bytes": 5.2e9,
                "data_start_mod_64": [0] if layout == "aligned" else [16], "ours_load_s": 1.0, "ours_runs": 1,
                "torch_load_s": 2.0, "torch_runs": 1, "speedup_vs_torch": 2.0 if met else 0.5,
                "ours_peak_rss_gib": 5.0, "ours_peak_rss_over_checkpoint": 1.03, "rss_target_met": True,
                "speed_target_met": met}

    records = [summary("aligned", "warm", True), summary("aligned", "cold", True), summary("hub", "warm", False)]
    text = "\n".join(report.section_load(records))
    assert "Our writer's layout" in text and "Hub layout" in text and "data starts at 16 mod 64" in text
    assert "aligned: faster than every peer warm yes, cold yes" in text
    assert "hub: faster than every peer warm **no**, cold n/a" in text and "0.50x / n/a" in text
    text = "\n".join(report.section_load(records[:2]))
    assert "hub: **not measured**" in text


def test_trace_summary_breaks_down_one_device_line_per_step(tmp_path):
    """A GPU trace repeats kernel time on 'XLA Ops' lines: the summary breaks down the busiest device line only,
    by kind and by name, divided by the number of steps; host lines are listed, never chosen."""
    import gzip

    from trace_summary import summarize

    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "XLA Ops"}}]
    kernels = [("sm90_xmma_gemm_bf16bf16_bf16f32", 300.0), ("loop_multiply_fusion", 40.0),
               ("input_reduce_fusion", 20.0), ("sm90_xmma_gemm_bf16bf16_bf16f32", 300.0)]
    starts = [sum(d for _, d in kernels[:i]) for i in range(len(kernels))]  # one stream: one kernel after another
    events = meta + [{"ph": "X", "pid": 2, "tid": 7, "ts": t, "dur": d, "name": n} for t, (n, d) in zip(starts, kernels)]
    events += [{"ph": "X", "pid": 2, "tid": 9, "ts": 0, "dur": 600.0, "name": "dot.3"},
               {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5000.0, "name": "PjitFunction(step)"}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = summarize(str(path), steps=2)
    assert summary["line"] == {"process": "/device:GPU:0", "thread": "Stream #7"}
    assert summary["busy_ms_per_step"] == pytest.approx(0.33)  # 660 us over 2 steps
    assert summary["kinds_ms_per_step"] == pytest.approx({"matmul": 0.3, "fusion": 0.02, "reduction": 0.01})
    assert summary["top"][0] == {"name": "sm90_xmma_gemm_bf16bf16_bf16f32", "kind": "matmul", "count": 2,
                                 "ms_per_step": 0.3}
    assert [line["thread"] for line in summary["lines"]][:2] == ["1", "Stream #7"]


def test_trace_summary_on_a_tpu_reads_the_ops_line_without_counting_a_loop_twice(tmp_path):
    """A TPU's device lines are steps, modules and ops; on the ops line a `while` loop encloses its body's fusions:
    the summary breaks down "XLA Ops", each op by its own time (the loop less its body)."""
    import gzip

    from trace_summary import self_times, summarize

    meta = [{"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:TPU:0"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 1, "args": {"name": "Steps"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 3, "args": {"name": "XLA Ops"}}]
    ops = [(0, 1000, "while.2"), (10, 400, "fusion.1"), (500, 400, "exponential_reduce_fusion.4"),
           (1000, 200, "convolution.7"), (1200, 100, "fusion.1")]
    events = meta + [{"ph": "X", "pid": 2, "tid": 3, "ts": t, "dur": d, "name": n} for t, d, n in ops]
    events += [{"ph": "X", "pid": 2, "tid": 1, "ts": 0, "dur": 1400, "name": "624"}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    summary = summarize(str(path), steps=1)
    assert summary["line"] == {"process": "/device:TPU:0", "thread": "XLA Ops"}
    assert summary["busy_ms_per_step"] == pytest.approx(1.3)  # 1000 + 200 + 100 us, the loop's body inside it
    by_name = {row["name"]: row["ms_per_step"] for row in summary["top"]}
    assert by_name == pytest.approx({"fusion.1": 0.5, "exponential_reduce_fusion.4": 0.4, "while.2": 0.2,
                                     "convolution.7": 0.2})
    assert self_times([{"ts": 0, "dur": 5}, {"ts": 5, "dur": 5}]) == [5.0, 5.0]  # adjacent, not nested


def test_gguf_export_bench_runs_at_tiny_shape(tmp_path):
    """bench/gguf_export.py end to end on a tiny random Gemma 3 with a Gemma-style tokenizer: export records, both
    decode peers, the summary (greedy tokens compared), and its BENCHMARKS.md rendering."""
    pytest.importorskip("llama_cpp")
    sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "tests"))
    import report_real
    from hf_reference import make_hf_model
    from tiny_tokenizers import save_gemma_tokenizer

    teacher = str(tmp_path / "teacher")
    make_hf_model("gemma3_text", vocab_size=save_gemma_tokenizer(teacher)).save_pretrained(teacher)
    out = tmp_path / "gguf-export.jsonl"
    root = os.path.dirname(BENCH)
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "gguf_export.py"), "--models", "teacher", "--teacher",
                           teacher, "--dtypes", "q8_0", "--repeats", "1", "--decode-dtypes", "f32",
                           "--llama-threads", "cores", "--decode-repeats", "1", "--prompt", "8", "--new", "4",
                           "--work", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("event") for r in records] == ["prompt", "export", "export", "decode", "decode", None]
    assert all("error" not in r and r["machine"]["cores"] and r["versions"]["llama_cpp"] for r in records), records
    summary = records[-1]
    assert summary["summary"] and summary["q8_0_gguf_bytes"] < summary["f32_gguf_bytes"]
    assert summary["ours_decode_tokens_per_s"] > 0 and summary["llama_f32_decode_tokens_per_s"] > 0
    assert summary["llama_f32_same_tokens"] is True, summary
    assert os.listdir(tmp_path / "work") == []  # the GGUF files and prompt removed
    text = "\n".join(report_real.section_gguf_export(records))
    assert "### GGUF export and llama.cpp" in text and "| teacher | f32 |" in text and "all equal" in text


def test_recovery_records_rebuild_the_command_that_made_them():
    """bench/real_recovery.py's setup (every record carries it) gives back the command that made the records,
    and BENCHMARKS.md's table of a setup prints it; a record from before a flag existed takes its default."""
    import shlex

    import real_recovery
    import report_real

    given = ["--student", "layers=9,hidden=512", "--steps", "96", "--batch-size", "2", "--seq-len", "128", "--lr",
             "1e-4", "--warmup", "5", "--corpus-bytes", "100000", "--general-mix", "0.25", "--teacher-correction",
             "12", "--teacher-correction-lr", "1e-4", "--no-restart", "--seed", "3", "--eval-tokens", "32768",
             "--eval-at", "24,48", "--run", "kl_noemb", "--run", "ce_noemb@1e-4"]
    args = real_recovery.parse_args(given)
    setup = real_recovery.setup_of(args)
    words = shlex.split(real_recovery.command_line(setup, args.run, [24, 48]))
    assert words[:2] == ["python", "bench/real_recovery.py"]
    again = real_recovery.parse_args(words[2:])
    assert {**real_recovery.setup_of(again), "tag": ""} == {**setup, "tag": ""}
    assert (again.run, again.eval_at, again.teacher) == (args.run, "24,48", "gguf:gemma3-270m")

    older = {key: setup[key] for key in ("student", "steps", "batch", "general_mix", "restart_rows", "seed",
                                         "eval_tokens")}
    rebuilt = real_recovery.parse_args(shlex.split(real_recovery.command_line({**older, "teacher_correction": 0},
                                                                              ["kl"]))[2:])
    assert (rebuilt.lr, rebuilt.warmup, rebuilt.teacher_correction, rebuilt.steps) == (3e-4, 2, 0, 96)

    scored = {"ce": 3.0, "ce_per_byte": 0.8, "kl": 0.5, "top1": 0.5, "passage_nll": [6.0, 3.0],
              "passage_kl": [1.0, 0.5], "passage_tokens": [2, 1], "passage_documents": [0, 1]}
    records = [{"bench": "recovery2", **setup, "event": event, "in-domain": {**scored, "ce": ce},
                "general": {**scored, "ce": ce}} for event, ce in (("teacher", 2.0), ("pruned", 4.0))]
    records += [{"bench": "recovery2", **setup, "run": run, "step": step, "in-domain": scored, "general": scored}
                for run in args.run for step in (24, 48, 96)]
    text = "\n".join(report_real.section_recovery_sets(records))
    assert "teacher correction: 12 steps at lr 0.0001" in text
    assert f"    {real_recovery.command_line(setup, args.run, [24, 48])}" in text


def _sweep_results(teacher, pruned, distilled, control, loops):
    """A results.json as the recipe writes it, with per-byte losses (in-domain, general) and loop shares."""
    names = ("teacher", "pruned (before distillation)", "distilled student", "CE-retrained pruned student (control)")
    rows = [{"model": name, "parameters": params, "safetensors_bytes": 4 * params, "loss_per_byte": losses[0],
             "general_loss_per_byte": losses[1], "kl_to_teacher": 0.5, "general_kl": 0.6, "loop_share": loop,
             "distinct_2": 0.5}
            for name, params, losses, loop in zip(names, (100, 30, 30, 30), (teacher, pruned, distilled, control),
                                                  loops)]
    pair = {"difference": -0.01, "low": -0.02, "high": 0.0}
    sets = {s: {"comparisons": [{"a": "distilled student", "b": names[3], "ce_per_byte": pair}]}
            for s in ("in-domain", "general")}
    return {"rows": rows, "sets": sets, "wall_time_s": 500.0, "phase_times_s": {}, "pairing": {"batches": {"same": True}}}


def test_student_sweep_records_gap_closure_and_the_goal(tmp_path, capsys):
    """bench/student_sweep.py: gap closure per byte on both sets, the issue's goal (<= 40% of the teacher, >= 65%
    closed on both sets, loops <= 1.5x the teacher's), the report's table and plot."""
    import student_sweep

    cases = {"good": ((0.5, 0.7), (1.5, 1.7), (0.8, 1.0), (0.9, 1.1), (0.2, 0.3, 0.2, 0.3)),   # 70% / 70%
             "loops": ((0.5, 0.7), (1.5, 1.7), (0.8, 1.0), (0.9, 1.1), (0.2, 0.3, 0.4, 0.3)),  # 2x the teacher
             "general": ((0.5, 0.7), (1.5, 1.7), (0.8, 1.1), (0.9, 1.1), (0.2, 0.3, 0.2, 0.3))}  # 60% general
    lines = []
    for name, case in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps(_sweep_results(*case)))
        entry = student_sweep.record(name, "layers=2", 10, str(folder))
        lines.append(json.dumps(entry))
        assert entry["share"] == pytest.approx(0.3)
        assert entry["distilled"]["in-domain"]["closure"] == pytest.approx(0.7)
        assert entry["control"]["general"]["closure"] == pytest.approx(0.6)
        assert entry["meets_goal"] is (name == "good")
    assert json.loads(lines[2])["distilled"]["general"]["closure"] == pytest.approx(0.6)
    records = tmp_path / "sweep.jsonl"
    records.write_text("\n".join(lines) + "\n")
    student_sweep.main(["--report", str(records), "--runs", str(tmp_path / "runs")])
    table = capsys.readouterr().out
    assert "| `layers=2` | 0.0M (30.0%) |" in table and "70% (60%)" in table and "40% (30%)" in table
    assert "more prompts" not in table and table.count("| yes |") == 1
    assert "| 1.000 -> 0.300 (0.400) / 1.000 -> 0.300 (0.400) |" in table  # above the teacher: pruned -> students
    assert (tmp_path / "sweep.png").stat().st_size > 0
    # --loops: an `nnx-surgery eval` of the runs' students over more prompts, matched by run folder
    loops = tmp_path / "loops.json"
    loops.write_text(json.dumps({"rows": [{"model": "teacher", "loop_share": 0.125},
                                          {"model": str(tmp_path / "loops" / "student"), "loop_share": 0.5},
                                          {"model": str(tmp_path / "good" / "student"), "loop_share": 0.21875}]}))
    student_sweep.main(["--report", str(records), "--runs", str(tmp_path / "runs"), "--loops", str(loops)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| loops, more prompts | meets the goal |") and lines[2].endswith(" 22% | no |")
    assert lines[3].endswith(" 50% | no |") and lines[4].endswith(" - | no |")
    assert "(over the more prompts: loops 12%)" in lines[-1]


def test_aot_goal_rows_read_the_latest_compiles_and_the_margin():
    import report_aot

    def tried(fits, headroom, tokens=16384, total=14.84):
        return {"fits": fits, "headroom": headroom, "tokens_per_step": tokens, "bytes": {"total": total * 2 ** 30},
                "setting": {"mesh": "fsdp=4,tp=2", "batch": 4, "accum": 2}}

    name, text, met = report_aot.full_mix_row({"tried": [tried(False, -0.03), tried(True, 0.06)]})
    assert met is True and "14.84 GiB" in text and "6% free: under the recipe's 10% margin" in text
    assert report_aot.full_mix_row({"tried": [tried(True, 0.2, tokens=8192)]})[2] is False  # fits, below 16k
    assert report_aot.full_mix_row({"tried": [tried(False, -0.5)]})[1:] == ("does not fit in any setting tried",
                                                                            False)
    rows = {row[0]: row for row in report_aot.target_rows()}  # the committed records: one row per goal
    assert len([n for n in rows if "full loss mix" in n]) == 1
    assert rows[next(n for n in rows if "Liger" in n)][2] is False


def test_budget_curve_plots_fabricated_results(tmp_path, capsys, monkeypatch):
    """bench/demo_budget_curve.py's reading and plotting, on results.json files made up here (a test of the plot
    code, not a result): closure per byte from each run's rows, one point per scale, the PNG and the table; the
    scales' batch and steps make their tokens exactly; the 100x run is `make demo`'s folder."""
    import demo_budget_curve as curve

    assert [curve.scale_settings(s) for s in (1, 10, 100)] == [
        {"batch": 16, "steps": 14, "warmup": 1, "tokens": 57_344},
        {"batch": 64, "steps": 35, "warmup": 1, "tokens": 573_440},
        {"batch": 64, "steps": 350, "warmup": 12, "tokens": 5_734_400}]
    assert curve.run_folder(str(tmp_path), 100).endswith(os.path.join("runs", "gemma3-270m-tpu"))
    assert curve.command(str(tmp_path), 10)[-6:] == ["--batch-size", "64", "--steps", "35", "--warmup-steps", "1"]
    assert "--eval-tasks" in curve.command(str(tmp_path), 1)
    assert "--eval-tasks" not in curve.command(str(tmp_path), 1, lm_eval=False)
    calls = []  # every scale's run in the one compilation cache (JAX_COMPILATION_CACHE_DIR), unless one is set
    monkeypatch.setattr(curve.subprocess, "call", lambda argv, env: calls.append((argv, env)) or 0)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert curve.run(str(tmp_path), [1, 10, 100], demo_folder=str(tmp_path / "demo")) == 0
    assert [argv[argv.index("--output") + 1] for argv, _ in calls] == [
        str(tmp_path / "1x"), str(tmp_path / "10x"), str(tmp_path / "demo")]
    assert {env["JAX_COMPILATION_CACHE_DIR"] for _, env in calls} == {str(tmp_path / "xla-cache")}
    calls.clear()
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "given"))
    assert curve.run(str(tmp_path), [1]) == 0 and calls[0][1]["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "given")

    def fabricated(tokens, distilled, control):  # CE per byte: teacher 1.0, pruned 2.0 on every set
        rows = [{"model": "teacher", "tokens": 0}, {"model": "pruned (before distillation)", "tokens": 0},
                {"model": "distilled student", "tokens": tokens},
                {"model": "CE-retrained pruned student (control)", "tokens": tokens}]
        for row, value in zip(rows, (1.0, 2.0, 2.0 - distilled, 2.0 - control)):
            row.update(loss_per_byte=value, general_loss_per_byte=value, far_loss_per_byte=value)
        return {"rows": rows, "wall_time_s": tokens / 1e4, "phase_times_s": {"distillation": 1.0}}

    folders = {}
    for scale, (distilled, control) in {1: (0.5, 0.4), 10: (0.7, 0.6)}.items():
        folder = tmp_path / f"{scale}x"
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps(fabricated(scale * 57_344, distilled, control)))
        folders[scale] = str(folder)
    folders[100] = str(tmp_path / "not-run")  # no results.json: no point
    found = curve.points(folders)
    assert [p["tokens"] for p in found] == [57_344, 573_440]
    assert found[1]["closed"]["far-domain"] == pytest.approx({"distilled": 0.7, "control": 0.6})
    path = curve.plot(found, str(tmp_path / "curve.png"))
    assert os.path.getsize(path) > 10_000
    table = curve.table(found).splitlines()
    assert table[2] == "| 1x | 57,344 | 50% / 40% | 50% / 40% | 50% / 40% | 6 s |"
    assert curve.main(["plot", "--root", str(tmp_path), "--scales", "1,10", "--out", str(tmp_path / "b.png")]) == 0
    assert "| 10x | 573,440 | 70% / 60% |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no run has a results.json"):
        curve.plot([], str(tmp_path / "none.png"))


@pytest.mark.slow
def test_lm_eval_speed_bench_records_rates_and_agreement(tmp_path):
    """bench/lm_eval_speed.py on the tiny model, both peers, one pass: its record (rates, ratios, answers
    compared) and BENCHMARKS.md's rendering of it (the target row is the real model's only)."""
    pytest.importorskip("lm_eval")
    pytest.importorskip("torch")
    import report_lm_eval

    out = tmp_path / "speed.jsonl"
    root = os.path.dirname(BENCH)
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "lm_eval_speed.py"), "--loglikelihood", "8",
                           "--generate", "2", "--passes", "1", "--batch", "4", "--record", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root,
                          env={**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["model"] == "tiny" and record["peers"] == ["nnx-surgery", "hf"]
    kinds = {k["kind"]: k for k in record["kinds"]}
    assert kinds["loglikelihood"]["requests"] == 8 and kinds["generate_until"]["requests"] == 2
    assert kinds["loglikelihood"]["agreement"]["max_abs_diff"] < 1e-4
    assert kinds["loglikelihood"]["agreement"]["greedy_flags_equal"] is True
    assert kinds["generate_until"]["agreement"] == {"same_text": 2, "of": 2}
    for entry in kinds.values():
        ours, theirs = entry["peers"]
        assert entry["ratio_warm"] == pytest.approx(ours["warm_per_s"] / theirs["warm_per_s"])
    text = "\n".join(report_lm_eval.render([record]))
    assert "| 8 loglikelihood |" in text and "2/2 texts equal" in text
    assert report_lm_eval.target_rows([record]) == []  # the goal is stated on the real model
    real = dict(record, model="real")
    (name, measured, met), = report_lm_eval.target_rows([real])
    assert met == (min(k["ratio_warm"] for k in record["kinds"]) >= 2.0) and "loglikelihood" in measured


def test_tpu_report_renders_the_committed_records():
    """bench/report_tpu.py on bench/results/tpu-v5e.jsonl: one step row per step record, the loss table, and the
    traced point's own-time breakdown (the loss loop's fusions, 32 chunks per step, lead it)."""
    import report_tpu

    with open(os.path.join(BENCH, "results", "tpu-v5e.jsonl")) as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    steps = [r for r in records if r.get("event") == "step" and "error" not in r]
    assert len(report_tpu.step_table(records).splitlines()) == 2 + len(steps)
    traced = report_tpu.trace_tables(records)
    assert "line `XLA Ops`" in traced and "| `bitcast_add_fusion.11` | fusion | 32 | 76.8 |" in traced


def test_tpu_targets_come_from_the_committed_records():
    """"Targets at a glance"'s TPU rows: the best kernel step per pair against its MFU goal, the kernels' loss
    temporaries, compiled against chip bytes, the TPU demo's closure and its one-command seconds (each phase's lap
    in the first command that finished it), with a goal missed where the records miss it."""
    import report_tpu

    rows = {name.split(":")[0]: (text, met) for name, text, met in report_tpu.committed_target_rows()}
    assert rows["TPU v5e, seq 2048"] == ("52.3% and 57.9% (the Pallas logit kernels; 42.2% and 54.1% with XLA's "
                                         "chunked loss)", True)
    assert rows["TPU v5e"][1] is True  # compiled within 10% (the last TPU v5e row of the two with that prefix)
    assert rows["TPU demo (`gemma3-270m-tpu`)"] == ("137% / 113% / 66%", True)
    with open(os.path.join(BENCH, "results", "demo-tpu-v5e-curve", "100x", "results.json"), encoding="utf-8") as handle:
        earlier = json.load(handle)  # the preset's run at the CPU demo's learning rate: far-domain short of 60%
    assert report_tpu.target_rows([], earlier)[0][1:] == ("115% / 98% / 55%", False)
    assert rows["TPU demo"] == ("about 502 s by its phases (1 command: 508 s)", True)
    laps = {"commands": [{"wall_s": 500, "laps": {"a": 100.0, "b": 50.0}},
                         {"wall_s": 90, "laps": {"a": 20.0, "c": 60.0}}]}
    assert report_tpu.uninterrupted_seconds(laps) == 210.0
    records = [{"event": "loss_memory", "logit_impl": "kernel", "tokens": 16384, "temp_bytes": 1.6e9}]
    assert report_tpu.target_rows(records) == [("TPU v5e: the logit loss's temporaries at 16k tokens (270M pair's "
                                                "head) <= 1.5 GB", "1.60 GB (kernels)", False)]
