"""One public name, one thing (issue 62): no public (non-underscore) function or class is defined at module level
in two modules of the package, unless it is a protocol name listed below, the same role in each module.

Read with `ast`, nothing imported: a `def` or `class` at a module's top level (or inside a top-level `if`/`try`)
counts; an import that re-exports a name (a package's `__init__`) does not. A name in two modules for two things
is renamed to say what it holds; where the two are the same thing, one is kept and the other imports it."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "nnx_surgery"

# name -> (why the same name is the same role in each module, the modules allowed to define it). A module not
# listed here defining one of these names fails the test too: add it here only if it plays the same role.
PROTOCOL_NAMES = {
    # a runnable entry's command line and its run (`python -m`, the installed scripts, recipes/*.py)
    "main": ("an entry point: argv in, the run", {
        "nnx_surgery.cli", "nnx_surgery.recipes.compress_command", "nnx_surgery.recipes.demo_choice",
        "nnx_surgery.recipes.distill_then_dpo"}),
    "parse_args": ("an entry point's argv read into its settings", {
        "nnx_surgery.recipes.compress_command", "nnx_surgery.recipes.distill_then_dpo"}),
    # a model family's hooks, collected into its `Family` (surgery/families/base.py: read=, write=, validate=)
    "read": ("a family's hook: its ModelConfig fields read from config.json", {
        "nnx_surgery.surgery.families.gemma", "nnx_surgery.surgery.families.llama"}),
    "write": ("a family's hook: its fields written back to config.json", {
        "nnx_surgery.surgery.families.gemma", "nnx_surgery.surgery.families.llama"}),
    "validate": ("a family's hook: what transformers would reject in its configs", {
        "nnx_surgery.surgery.families.gemma", "nnx_surgery.surgery.families.llama"}),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node
        elif isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(block)


def public_definitions() -> dict[str, list[str]]:
    """name -> the modules defining it (def or class at module level), for every public name."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in _top_level(tree.body):
            if not node.name.startswith("_"):
                found[node.name].append(f"{module_name(path)}:{node.lineno}")
    return found


def collisions() -> dict[str, list[str]]:
    """Public names defined in more than one module, less the protocol names in their listed modules."""
    out = {}
    for name, places in public_definitions().items():
        modules = {place.partition(":")[0] for place in places}
        if len(modules) < 2:
            continue
        if name in PROTOCOL_NAMES and modules <= PROTOCOL_NAMES[name][1]:
            continue
        out[name] = places
    return out


def test_no_public_name_is_defined_twice():
    found = collisions()
    assert not found, ("public names defined in more than one module (rename each to say what it holds, or keep "
                       "one and import it; a protocol name goes in PROTOCOL_NAMES with its reason):\n" +
                       "\n".join(f"  {name}: {', '.join(places)}" for name, places in sorted(found.items())))


def test_the_protocol_names_are_still_defined_where_listed():
    """The allow-list holds no stale entry: each listed module still defines the name."""
    defined = public_definitions()
    for name, (_, modules) in PROTOCOL_NAMES.items():
        where = {place.partition(":")[0] for place in defined.get(name, [])}
        assert modules <= where, f"{name}: listed for {sorted(modules - where)}, which no longer define it"


def test_the_check_sees_a_collision(tmp_path, monkeypatch):
    """The rule itself: two modules defining one public name fail; underscore names and re-exports do not."""
    package = tmp_path / PACKAGE
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from .a import build\n")
    (package / "a.py").write_text("def build():\n    pass\n\ndef _private():\n    pass\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("import sys\nif sys:\n    class build:\n        pass\n"
                                          "def _private():\n    pass\ndef main():\n    pass\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    found = collisions()
    assert set(found) == {"build"} and len(found["build"]) == 2
