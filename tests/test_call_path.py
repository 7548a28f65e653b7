"""How far a reader walks to follow compress's argv (issue 62: "the compress entry's argv, followed through the call
graph: <= 60 places visited and <= 30 returns to a module already left"), measured on `nnx-surgery compress
--preset tiny --dry-run` run in this process under `sys.setprofile`.

The counting rule:

* The path starts at `nnx_surgery.recipes.compress_command.main`, the function that receives the argv. A function
  of nnx_surgery is on the path when it is called directly from a function already on the path. Functions of the
  standard library, jax, flax, numpy and every other library are not places and are not followed: an nnx_surgery
  function that one of them calls back (a jitted or `eval_shape`d function) is not on the path. (A dataclass's
  `__post_init__`, called by the `__init__` that `dataclasses` generates, is: see the next point.)
* A comprehension, generator expression or lambda is part of the function that holds it, and so is a method that
  `dataclasses` generates (`__init__`, `__eq__`, ...: code whose file is "<string>"): the functions they call count
  as called by that function. Module-level code (an import made while the command runs) and what it calls are
  not on the path.
* A place is one function (its module and qualified name): entered once or a thousand times, it counts once.
  Places visited = how many distinct functions are on the path.
* The walk is the reader's: each place read once, the first time it is called, from the place that first called
  it (the first-call tree, read depth first in the order the calls happened). A move is a step into a callee or
  back to its caller; a move that crosses modules lands in a module. Returns to a module already left = the moves
  that land in a module the reader has been in before and left (stepping back to the caller's module after a
  call into another one, or calling into a module read earlier).

The dry run resolves the settings, prepares the devices and builds the run's settings (the tiny teacher's config
only, no weights, nothing written), then prints the report: the whole of `compress` a run does before its
first phase."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "nnx_surgery") + os.sep
ENTRY = ("nnx_surgery.recipes.compress_command", "main")
PART_OF_CALLER = {"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>", "<lambda>"}
GOAL_PLACES, GOAL_RETURNS = 60, 30


def _module(filename: str) -> str:
    relative = filename[len(PACKAGE) - len("nnx_surgery") - 1:-len(".py")]
    parts = relative.split(os.sep)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _kind(code) -> str:
    """'place' (a function of nnx_surgery), 'inner' (part of its caller), 'import' or 'other' (not followed)."""
    if code.co_filename.startswith(PACKAGE):
        if code.co_name == "<module>":
            return "import"
        return "inner" if code.co_name in PART_OF_CALLER else "place"
    return "inner" if code.co_filename == "<string>" else "other"


def trace(run) -> tuple[list[tuple[str, str]], dict[tuple[str, str], tuple[str, str] | None]]:
    """(the places in the order first entered, each place's first caller) while `run()` runs."""
    order: list[tuple[str, str]] = []
    parent: dict[tuple[str, str], tuple[str, str] | None] = {}
    stack: list[tuple[str, str] | None] = []  # per frame entered: the place it belongs to, None: not on the path

    def profile(frame, event, _arg):
        if event == "call":
            code, caller = frame.f_code, (stack[-1] if stack else None)
            kind = _kind(code)
            if kind == "place":
                place = (_module(code.co_filename), code.co_qualname)
                on_path = place == ENTRY or caller is not None
                if on_path and place not in parent:
                    parent[place] = caller
                    order.append(place)
                stack.append(place if on_path else None)
            else:
                stack.append(caller if kind == "inner" else None)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return order, parent


def walk(order: list[tuple[str, str]], parent: dict) -> dict:
    """The reader's walk over the first-call tree: places, moves across modules, returns to a module already left."""
    children: dict = {place: [] for place in order}
    for place in order:
        if parent[place] is not None:
            children[parent[place]].append(place)
    seen, moves, returns, back_to_caller = set(), 0, 0, 0

    def land(module: str, current: str, is_return: bool) -> None:
        nonlocal moves, returns, back_to_caller
        if module != current:
            moves += 1
            if module in seen:
                returns += 1
                back_to_caller += is_return
        seen.add(module)

    def read(place) -> None:
        for child in children[place]:
            land(child[0], place[0], False)
            read(child)
            land(place[0], child[0], True)

    root = order[0]
    seen.add(root[0])
    read(root)
    return {"places": len(order), "modules": len({p[0] for p in order}), "moves": moves, "returns": returns,
            "returns_to_caller": back_to_caller, "calls_into_a_module_read_before": returns - back_to_caller}


def measure_dry_run(tmp: Path) -> tuple[dict, list[tuple[str, str]], dict]:
    from nnx_surgery.recipes import compress_command

    argv = ["--preset", "tiny", "--dry-run", "--output", str(tmp / "run"), "--cache-dir", str(tmp / "cache")]
    with contextlib.redirect_stdout(io.StringIO()):
        order, parent = trace(lambda: compress_command.main(argv, prog="nnx-surgery compress"))
    assert order and order[0] == ENTRY
    return walk(order, parent), order, parent


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Measured in a fresh interpreter: what earlier tests cached (a preset read once) would shorten the path."""
    folder = tmp_path_factory.mktemp("call-path")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, "--json", str(folder)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    return found["counted"], [tuple(p) for p in found["order"]]


def test_the_rule_on_a_known_tree():
    """main (m) -> a.f -> a.g, a.f -> b.h -> a.k: b entered once, a re-entered twice (after b.h, and by b.h's call
    into a.k), then back to m."""
    m, f, g, h, k = ("m", "main"), ("a", "f"), ("a", "g"), ("b", "h"), ("a", "k")
    counted = walk([m, f, g, h, k], {m: None, f: m, g: f, h: f, k: h})
    assert counted["places"] == 5 and counted["moves"] == 6
    # m->a (new), a->a, a->b (new), b->a (call into a: read before), a->b (back to h's module), b->a, a->m
    assert counted["returns"] == 4 and counted["returns_to_caller"] == 3


def test_the_dry_run_path_is_measured(measured):
    counted, order = measured
    print(f"\ncompress --preset tiny --dry-run: {counted}")
    assert counted["places"] == len(set(order)) > 10
    assert {"nnx_surgery.recipes.compress.resolution", "nnx_surgery.recipes.compress.pipeline"} <= \
        {module for module, _ in order}


# Measured when this test was written: 179 places in 39 modules (92 resolving the settings, 78 building the run's
# settings and its report, 9 preparing the devices), 144 returns to a module already left (91 back to a caller's
# module, 53 calls into a module read before). Then 168 places in 37 modules, 134 returns: the distill section's
# defaults read from the declarations (no DistillConfig made and written out for them: it is built once), --aot
# dispatched before the run's devices are prepared, a declaration's flag, path and default read once. Every module
# entered is returned from, so the returns are at least the modules less one: the goal needs a path through at
# most 31 modules. Strict: once the path meets the goal, this fails until the mark goes.
@pytest.mark.xfail(strict=True, reason="the dry run's path is longer than the goal: 168 places, 134 returns")
def test_the_dry_run_path_meets_the_goal(measured):
    counted, _ = measured
    assert counted["places"] <= GOAL_PLACES and counted["returns"] <= GOAL_RETURNS, counted


if __name__ == "__main__":  # python tests/test_call_path.py [--json FOLDER]: the numbers and the first-call tree
    import tempfile

    if sys.argv[1:2] == ["--json"]:
        counted, order, _ = measure_dry_run(Path(sys.argv[2]))
        print(json.dumps({"counted": counted, "order": order}))
        sys.exit(0)
    with tempfile.TemporaryDirectory() as folder:
        counted, order, parent = measure_dry_run(Path(folder))
    depth: dict = {}
    for place in order:
        depth[place] = 0 if parent[place] is None else depth[parent[place]] + 1
        print("  " * depth[place] + f"{place[0]}.{place[1]}")
    print(counted)
