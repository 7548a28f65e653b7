"""`--aot TARGET`: the recipe's own programs compiled for a target this machine does not have, with the bytes per
device checked against counts made here from the configs' sizes and the mesh (not by the code under test).

The tiny preset's whole recipe compiles on `cpu:8` (a subprocess: the host devices are asked for before JAX
starts); the tiny recipe's main step compiles for a TPU slice where libtpu is installed (`make test` installs it
in .venv/libtpu). The real Gemma 7B -> gemma-2b train step for v5e-8 takes XLA 6 minutes of CPU time and 6 GB to
compile (12 minutes beside another run), a quarter of the suite's budget on one worker: it runs with
`make test-aot-7b` (NNX_SURGERY_AOT_7B=1), and bench/aot_table.py records the same compiles for every target. Bad
input is one line, exit 2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from recipe_env import recipe_env, shared_basetemp
from refusal_env import assert_refused, run

from nnx_surgery.recipes.aot import report as aot_report, search as aot_search, targets as aot_targets
from nnx_surgery.refusals import RecipeError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RECIPE = os.path.join(ROOT, "recipes", "gemma_7b_to_2b.py")
TINY = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8"]
# the main step, the one-shot cut's MLP refit and the evaluation: no control, no calibration, no K/V warm-up
MAIN_ONLY = ["--compression", "oneshot", "--control", "none", "--calibration-samples", "0", "--kv-warmup", "0"]


def libtpu_missing() -> str | None:
    try:
        aot_targets.find_libtpu()
    except RecipeError as error:
        return str(error)
    return None


def compile_recipe(tmp_path_factory, output, *flags, timeout=900) -> dict:
    proc = subprocess.run([sys.executable, RECIPE, *flags, "--output", str(output)], capture_output=True, text=True,
                          env=recipe_env(shared_basetemp(tmp_path_factory)), timeout=timeout)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr[-3000:]
    with open(os.path.join(output, "aot_report.json")) as handle:
        return json.load(handle)


def gemma_parameters(vocab, hidden, mlp, layers, heads, kv_heads, head_dim) -> tuple[int, int]:
    """(matrix entries, vector entries) of a tied Gemma 1 model: embedding, q/k/v/o, gate/up/down per layer;
    two RMSNorm scales per layer and the final one."""
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * mlp
    return vocab * hidden + layers * per_layer, (2 * layers + 1) * hidden


def bytes_per_device(counts: tuple[int, int], devices: int, itemsize: int = 4) -> int:
    """fsdp over `devices`: every matrix split in `devices` parts (one of its dimensions), every vector whole."""
    matrices, vectors = counts
    assert matrices % devices == 0
    return itemsize * (matrices // devices + vectors)


# The tiny preset's teacher (tiny_teacher.TEACHER_CONFIG: byte vocabulary of 260) and its `scaled` students.
TEACHER = (260, 48, 384, 14, 4, 4, 16)
STAGE_A = (260, 48, 256, 9, 4, 4, 16)  # depth and MLP width of the final student, the rest the teacher's
STUDENT = (260, 32, 256, 9, 2, 1, 16)


@pytest.fixture(scope="module")
def tiny_cpu_report(tmp_path_factory):
    output = tmp_path_factory.mktemp("aot") / "tiny"
    output.mkdir()
    (output / "notes.txt").write_text("an earlier file\n")  # a folder in use is fine: only the report is written
    report = compile_recipe(tmp_path_factory, output, *TINY, "--aot", "cpu:8", "--aot-search")
    assert sorted(os.listdir(output)) == ["aot_report.json", "notes.txt"]
    assert (output / "notes.txt").read_text() == "an earlier file\n"
    return report


def test_tiny_recipe_compiles_every_program_on_eight_host_devices(tiny_cpu_report):
    report = tiny_cpu_report
    rows = {row["program"]: row for row in report["programs"]}
    assert list(rows) == ["calibration forward", "MLP refit (stage A)", "A: depth+MLP", "B1: merged K/V + norms",
                          "B2: everything", "evaluation", "control (scratch)"]
    assert report["target"]["devices"] == 8 and report["settings"]["mesh"] == "fsdp=8" and report["fits"]
    teacher = bytes_per_device(gemma_parameters(*TEACHER), 8)
    student = bytes_per_device(gemma_parameters(*STUDENT), 8)
    stage_a = bytes_per_device(gemma_parameters(*STAGE_A), 8)
    main = rows["B2: everything"]["bytes"]
    assert main["teacher_parameters"] == teacher and main["student_parameters"] == student
    assert main["optimizer_state"] == 2 * student + 4  # Adam's two moments, sharded like the weights, and its count
    assert rows["A: depth+MLP"]["bytes"]["student_parameters"] == stage_a
    assert rows["A: depth+MLP"]["bytes"]["optimizer_state"] == 2 * stage_a + 4
    assert rows["control (scratch)"]["bytes"]["teacher_parameters"] == 0  # plain CE: no teacher on the devices
    refit = rows["MLP refit (stage A)"]["bytes"]  # the stage-A cut narrows the MLP 384 -> 256: refitted on 64 rows
    assert refit["teacher_parameters"] == teacher and refit["student_parameters"] == stage_a
    assert refit["optimizer_state"] == 0
    held = (64 + 8) * 32 * STAGE_A[1] * 4  # every row's layer inputs kept between layers, and the batch's own
    assert held // 8 <= refit["batch"] <= held  # sharded over the 8 devices at best, replicated at worst
    assert rows["evaluation"]["bytes"]["optimizer_state"] == 0
    for row in rows.values():
        assert row["bytes"]["batch"] > 0 and row["bytes"]["temporaries"] > 0 and row["flops_per_device_xla"] > 0
        assert row["bytes"]["total"] >= row["bytes"]["arguments"] >= sum(
            row["bytes"][key] for key in ("teacher_parameters", "student_parameters", "optimizer_state"))


def test_search_names_the_flags_of_a_setting_that_fits(tiny_cpu_report):
    found = tiny_cpu_report["search"]
    assert found["program"] == "A: depth+MLP"  # the train step that needs the most memory
    assert found["best"]["fits"] and found["best"]["headroom"] >= aot_report.HEADROOM
    assert found["flags"].startswith("--mesh fsdp=") and "--grad-accum" in found["flags"]


@pytest.mark.skipif(libtpu_missing() is not None, reason=f"libtpu not installed: {libtpu_missing()}")
def test_tiny_step_compiles_for_a_tpu_slice(tmp_path_factory):
    output = tmp_path_factory.mktemp("aot") / "tpu"
    report = compile_recipe(tmp_path_factory, output, *TINY, *MAIN_ONLY, "--aot", "v5e:2x2", "--aot-tokens", "1e9")
    assert report["target"]["devices"] == 4 and report["target"]["chip"]["name"] == "v5e"
    # XLA's own figure for a v5e's usable HBM (its out-of-memory refusals say 15.75G), not the chip's nominal 16 GiB
    assert report["target"]["memory_per_device"] == int(15.75 * 2 ** 30)
    rows = {row["program"]: row for row in report["programs"]}
    assert list(rows) == ["MLP refit", "B2: everything", "evaluation"]
    main = rows["B2: everything"]
    assert main["bytes"]["student_parameters"] == bytes_per_device(gemma_parameters(*STUDENT), 4)
    assert main["bytes"]["teacher_parameters"] == bytes_per_device(gemma_parameters(*TEACHER), 4)
    refit = rows["MLP refit"]["bytes"]  # the teacher's MLP 384 -> 256 at once, refitted beside both models
    assert refit["teacher_parameters"] == main["bytes"]["teacher_parameters"]
    assert refit["student_parameters"] == main["bytes"]["student_parameters"] and refit["optimizer_state"] == 0
    assert rows["MLP refit"]["fits"]
    assert main["fits"] and main["tokens_per_s"] > 0 and report["days_to_budget"] > 0


@pytest.mark.skipif(libtpu_missing() is not None, reason=f"libtpu not installed: {libtpu_missing()}")
def test_a_single_chip_is_a_target():
    """v5e:1x1 (and a two-chip v5e:2x1): slices smaller than a host, which libtpu refuses under its default host
    bounds, resolve with their own bounds; a v5e chip's usable HBM as XLA states it."""
    code = ("import json; from nnx_surgery.recipes.aot import targets as a; "
            "print(json.dumps([(len(t.devices), t.memory_per_device, t.hosts) for t in "
            "(a.resolve_target('v5e:1x1'), a.resolve_target('v5e:2x1'))]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [[1, int(15.75 * 2 ** 30), 1], [2, int(15.75 * 2 ** 30), 1]]


SEVEN_B_STEP = """
import dataclasses, json, sys
from nnx_surgery.recipes.aot import programs as aot_programs, report as aot_report, targets as aot_targets
from nnx_surgery.recipes.compress import resolution
config = resolution.resolve(sys.argv[1:])
target = aot_targets.resolve_target(config.aot.target)
run = aot_programs.aot_run(resolution.replaced(config, training={"mesh": "fsdp=8"}))
entry = next(e for e in aot_programs.run_programs(run, target) if e.name == "B2: everything")
print(json.dumps(aot_report.measure(entry.build(), target, 0.4)))
"""


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("NNX_SURGERY_AOT_7B") != "1",
                    reason="the 7B compile takes 6 minutes of CPU and 6 GB: make test-aot-7b runs it")
@pytest.mark.skipif(libtpu_missing() is not None, reason=f"libtpu not installed: {libtpu_missing()}")
def test_gemma_7b_to_2b_step_compiles_for_a_v5e_8(tmp_path):
    """The recipe's own job: Gemma 7B (bf16) teaching the gemma-2b shape (float32 master weights and Adam, bf16
    compute), logit KL, 8 x 1024 tokens per step, fsdp over the 8 chips of a v5e-8: its main train step alone
    (the command would also compile the evaluation and search when it does not fit). Either it fits, or XLA's
    refusal gives the bytes it needs, above the chip's."""
    flags = ["--teacher", "gemma-7b", "--student", "gemma-2b", "--precision", "bf16", "--seq-len", "1024",
             "--batch-size", "8", "--feature-weight", "0", *MAIN_ONLY, "--aot", "v5e:2x4", "--output",
             str(tmp_path / "o")]
    proc = subprocess.run([sys.executable, "-c", SEVEN_B_STEP, *flags], capture_output=True, text=True,
                          env=recipe_env(tmp_path), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    gib = 2 ** 30
    assert 1.9 * gib < row["bytes"]["teacher_parameters"] < 2.2 * gib  # 8.54B bf16 parameters over 8 chips
    assert 1.1 * gib < row["bytes"]["student_parameters"] < 1.3 * gib  # 2.51B float32 parameters over 8
    assert row["bytes"]["optimizer_state"] == pytest.approx(2 * row["bytes"]["student_parameters"], abs=64)
    if row["fits"]:
        assert row["bytes"]["total"] < 16 * gib and row["tokens_per_s"] > 0
    else:
        assert row["out_of_memory"]["needed"] > row["out_of_memory"]["available"] > 15 * gib


def test_oom_refusal_is_read_as_an_answer():
    error = RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
                         "hbm. HLO temporaries (16.10G) exceeds available HBM (15.75G).")
    found = aot_targets.out_of_memory(error)
    assert found["needed"] == pytest.approx(16.10 * 2 ** 30) and found["available"] == pytest.approx(15.75 * 2 ** 30)
    assert aot_targets.out_of_memory(ValueError("shapes differ")) is None


def test_candidates_keep_the_tokens_per_step(monkeypatch):
    from nnx_surgery.recipes.compress.resolution import resolve
    flags = resolve(["--preset", "tiny", "--batch-size", "8", "--output", "/nonexistent/out"])
    found = aot_search.candidates(flags, 4)
    assert found and all(c.batch_size * c.grad_accum == 8 and c.batch_size % c.mesh["fsdp"] == 0 for c in found)
    assert found[0].remat is None and found[0].grad_accum == 1  # the cheapest estimate first
    assert found[0].logit_impl == "fused"
    # the two-pass logit loss (less memory, the logits made twice) is tried for a forward-KL run, and its flags
    # are ones the recipe takes
    two_pass = [c for c in found if c.logit_impl == "two_pass"]
    assert two_pass and min(found.index(c) for c in two_pass) > 0
    text = two_pass[0].flags_text()
    assert text.endswith("--set logit_impl=two_pass")
    words = text.split()
    words = words[:words.index("--mesh")] + words[words.index("--mesh") + 2:]  # this process has one device
    again = resolve(["--preset", "tiny", "--output", "/nonexistent/out", *words])
    assert again.distill.logit_impl == "two_pass" and again.data.batch_size == two_pass[0].batch_size
    for other in (["--loss", "jsd"], ["--top-k", "8"]):  # losses the two-pass loss does not compute
        flags = resolve(["--preset", "tiny", "--batch-size", "8", "--output", "/nonexistent/out", *other])
        assert {c.logit_impl for c in aot_search.candidates(flags, 4)} == {"fused"}


@pytest.mark.parametrize("flags, culprit", [
    (["--aot", "v9z:2x2"], "v5e:2x4"),  # unknown chip: the known topologies listed
    (["--aot", "v5e:two"], "v5e:2x4"),
    (["--aot", "cpu:1", "--mesh", "fsdp=2"], "uses 2 device(s)"),
    (["--aot-search"], "--aot"),
    (["--aot", "cpu:1", "--aot-mfu", "1.5"], "--aot-mfu"),
])
def test_bad_aot_input_is_one_line(tmp_path, flags, culprit):
    output = tmp_path / "out"
    assert_refused(*run("compress", *TINY, *flags, "--output", str(output)), culprit)
    assert not output.exists()


def test_config_no_family_reads_is_refused(tmp_path):
    folder = tmp_path / "bert"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    output = tmp_path / "out"
    assert_refused(*run("compress", "--teacher", str(folder), "--student", "layers=0.5", "--aot", "cpu:1",
                        "--output", str(output)), "bert")
    assert not output.exists()


@pytest.mark.skipif(libtpu_missing() is not None, reason=f"libtpu not installed: {libtpu_missing()}")
def test_batch_the_slice_cannot_split_is_refused_before_compiling(tmp_path):
    code, out, err = run("compress", *TINY, "--batch-size", "6", "--aot", "v5e:2x2", "--output", str(tmp_path / "o"))
    assert_refused(code, out, err, "batch")
    assert "compiled" not in out


@pytest.mark.parametrize("version", [None, "0.0.1"])
def test_missing_or_mismatched_libtpu_names_the_pin(tmp_path, monkeypatch, version):
    library = tmp_path / "libtpu" / "libtpu.so"
    if version:
        library.parent.mkdir()
        library.write_bytes(b"")
        (tmp_path / f"libtpu-{version}.dist-info").mkdir()
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(library))
    code, out, err = run("compress", *TINY, "--aot", "v5e:2x4", "--output", str(tmp_path / "o"))
    assert_refused(code, out, err, f"libtpu=={aot_targets.libtpu_pin()}")
    assert "--target" in err
