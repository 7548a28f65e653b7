"""The tokenizer files of a student with a trimmed vocabulary (`Plan.kept_vocab`), written beside its weights.

From the teacher's folder, each file is rewritten for the kept pieces, student id i being teacher id kept[i]:

    tokenizer.json            vocabulary renumbered 0..N-1 in kept order; merges kept when both parents and the
                              result survive (in the teacher's order); added tokens, the post-processor's special
                              ids and the padding id renumbered. Checked by loading it with `tokenizers`.
    tokenizer_config.json     `added_tokens_decoder` renumbered; special-token lists without dropped tokens (else
    special_tokens_map.json   transformers would add them back as new ids past the embedding)
    added_tokens.json         renumbered
    generation_config.json    every `*_token_id` renumbered
    chat_template.*           copied as they are

`tokenizer.model` (a SentencePiece model, which `tokenizer.json` supersedes) is not written: it would give the
teacher's ids. `transformers.AutoTokenizer.from_pretrained(student_folder)` loads the result as it is.
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any, Callable

from nnx_surgery.surgery.storage.atomic import write_json
from nnx_surgery.surgery.storage.hf_checkpoint import resolve_source
from nnx_surgery.surgery.plans.plan_record import Plan, PlanError
from nnx_surgery.surgery.storage.safetensors_stream import confined_path
from nnx_surgery.surgery.plans.vocab_selection import SPECIAL_LISTS, TeacherTokenizer, remap_token_ids

COPIED = ("chat_template.jinja", "chat_template.json")


def student_tokenizer(plan: Plan, source) -> tuple[str | None, dict[str, Callable[[str], None]]]:
    """(the source whose tokenizer files the student gets as they are, extra files): the teacher's `source` (a
    folder or Hub repo id) for a plan that keeps the whole vocabulary; else None and the trimmed files (a warning
    when there is no source to make them from: the student is then written without a tokenizer)."""
    if plan.kept_vocab is None:
        return source, {}
    if source is None:
        warnings.warn("the plan trims the vocabulary but no teacher folder was given to make the student's "
                      "tokenizer from; the student is written without tokenizer files (pass source=).", stacklevel=3)
        return None, {}
    source = os.fspath(source)
    return None, trimmed_tokenizer_files(source if os.path.isdir(source) else resolve_source(source), plan)


def trimmed_tokenizer_files(folder: str, plan: Plan) -> dict[str, Callable[[str], None]]:
    """{file name: writer(path)} of the student's tokenizer files (`write_hf_folder`'s `extra_files`), from the
    teacher's tokenizer in `folder`, which must be the one the plan chose its pieces from (PlanError otherwise).
    The trimmed tokenizer is built here, so a problem shows before any weights are written."""
    kept_vocab = plan.kept_vocab
    if kept_vocab is None:
        raise PlanError("this plan keeps the teacher's whole vocabulary: the student takes the teacher's tokenizer "
                        "files as they are, not trimmed ones.")
    tokenizer = TeacherTokenizer.read(folder)
    planned = (plan.scores.get("vocab") or {}).get("tokenizer_sha256")
    if planned is not None and planned != tokenizer.sha256:
        raise PlanError(f"{tokenizer.where} is not the tokenizer this plan chose its pieces from (SHA-256 "
                        f"{tokenizer.sha256} vs {planned} in the plan); pass the teacher folder the plan was made "
                        "with as source, or plan again.")
    new_id = {teacher: student for student, teacher in enumerate(kept_vocab)}
    data = trimmed_tokenizer_json(tokenizer, new_id)
    kept_pieces = {tokenizer.pieces[i] for i in kept_vocab if i in tokenizer.pieces}
    files: dict[str, Callable[[str], None]] = {"tokenizer.json": lambda path: write_json(path, data, indent=None)}
    for name, fix in (("tokenizer_config.json", lambda c: _tokenizer_config(c, new_id, kept_pieces)),
                      ("special_tokens_map.json", lambda c: _without_dropped(c, kept_pieces)),
                      ("added_tokens.json", lambda c: {k: new_id[v] for k, v in c.items() if v in new_id}),
                      ("generation_config.json", lambda c: remap_token_ids(c, new_id))):
        content = _read_json(folder, name)
        if content is not None:
            files[name] = lambda path, content=fix(content): write_json(path, content)
    for name in COPIED:
        source = confined_path(folder, name, f"{folder}: {name}")
        if os.path.isfile(source):
            files[name] = lambda path, source=source: shutil.copyfile(source, path)
    return files


def trimmed_tokenizer_json(tokenizer: TeacherTokenizer, new_id: dict[int, int]) -> dict[str, Any]:
    """The teacher's tokenizer.json restricted to the pieces `new_id` keeps (teacher id -> student id)."""
    data, model = tokenizer.data, tokenizer.data["model"]
    vocab = sorted(((piece, new_id[i]) for piece, i in model["vocab"].items() if i in new_id), key=lambda p: p[1])
    kept = {piece for piece, _ in vocab}
    merges = [merge for merge, (left, right) in zip(model.get("merges") or [], tokenizer.merges)
              if left in kept and right in kept and left + right in kept]
    out = {**data, "model": {**model, "vocab": dict(vocab), "merges": merges},
           "added_tokens": [{**t, "id": new_id[t["id"]]} for t in data.get("added_tokens") or [] if t["id"] in new_id],
           "post_processor": _processor(data.get("post_processor"), new_id, tokenizer.where)}
    if isinstance(data.get("padding"), dict) and data["padding"].get("pad_id") is not None:
        out["padding"] = {**data["padding"], "pad_id": _mapped(data["padding"]["pad_id"], new_id, "padding",
                                                               tokenizer.where)}
    from tokenizers import Tokenizer
    try:
        Tokenizer.from_str(json.dumps(out))
    except Exception as err:  # tokenizers raises plain Exceptions
        raise PlanError(f"{tokenizer.where}: the trimmed tokenizer does not load ({err}); the plan's kept_vocab "
                        "does not fit this tokenizer. Plan again with this teacher's tokenizer.") from None
    return out


def _processor(processor: dict | None, new_id: dict[int, int], where: str) -> dict | None:
    """A post-processor with its special-token ids renumbered."""
    if not processor:
        return processor
    out = dict(processor)
    if "special_tokens" in processor:
        out["special_tokens"] = {name: {**entry, "ids": [_mapped(i, new_id, name, where) for i in entry["ids"]]}
                                 for name, entry in processor["special_tokens"].items()}
    for key in ("sep", "cls"):
        if isinstance(processor.get(key), list):
            out[key] = [processor[key][0], _mapped(processor[key][1], new_id, processor[key][0], where)]
    if "processors" in processor:
        out["processors"] = [_processor(p, new_id, where) for p in processor["processors"]]
    return out


def _mapped(token_id: int, new_id: dict[int, int], name: str, where: str) -> int:
    if token_id not in new_id:
        raise PlanError(f"{where}: {name} (teacher id {token_id}) is not among the plan's kept pieces, but the "
                        "tokenizer inserts it; plan again with this teacher's tokenizer.")
    return new_id[token_id]


def _tokenizer_config(config: dict, new_id: dict[int, int], kept: set[str]) -> dict:
    out = _without_dropped(config, kept)
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        out["added_tokens_decoder"] = {str(new_id[int(k)]): v for k, v in decoder.items() if int(k) in new_id}
    return out


def _without_dropped(config: dict, kept: set[str]) -> dict:
    """The special-token lists of a tokenizer config without tokens the student does not have."""
    out = dict(config)
    for key in SPECIAL_LISTS:
        values = config.get(key)
        content = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
        if isinstance(values, list):
            out[key] = [v for v in values if content(v) in kept]
        elif isinstance(values, dict):
            out[key] = {name: v for name, v in values.items() if content(v) in kept}
    return out


def _read_json(folder: str, name: str) -> dict | None:
    path = confined_path(folder, name, f"{folder}: {name}")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
