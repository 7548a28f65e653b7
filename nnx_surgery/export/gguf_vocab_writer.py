"""A folder's tokenizer as llama.cpp's SentencePiece vocabulary (`tokenizer.ggml.*`): the inverse of gguf_vocab_reader.py.

llama.cpp tokenises Gemma with its own SentencePiece implementation (`tokenizer.ggml.model` "llama"): one token
string, score and type per id, plus the special-token ids and the add_bos/add_eos flags. A Hugging Face folder holds
the same vocabulary as a byte-fallback BPE (`tokenizer.json`), which is read back like this:

* the token of id i is the BPE vocabulary's (or the added token's) string; ids the folder leaves unnamed up to
  config.json's vocab_size (the embedding's rows) become `[PAD<i>]` UNUSED tokens, as llama.cpp's converter pads a
  SentencePiece vocabulary;
* types: added tokens marked special are CONTROL, other added tokens USER_DEFINED, `<0xNN>` pieces BYTE, the unknown
  token UNKNOWN when it is not an added token, the rest NORMAL. Runs of two or more "▁" are USER_DEFINED too:
  Gemma's SentencePiece model declares whitespace runs as user-defined symbols, which tokenizer.json cannot say (they
  are reached by BPE merges there). USER_DEFINED tokens are stored with real spaces (the converter's spelling), so
  llama.cpp matches them in the raw text before it escapes spaces;
* scores: CONTROL, USER_DEFINED, UNUSED and UNKNOWN -1000, BYTE 0, NORMAL tokens 0, -1, -2, ... in the order the
  folder's BPE merges first make them, then the tokens no merge makes (single characters) by id. llama.cpp merges
  the adjacent pair whose result scores highest, transformers the pair whose merge comes first: the same
  tokenisation. tokenizer.json keeps no scores, so only their order survives: the published Gemma 3 GGUFs score their
  single characters lower than this count, which changes nothing, since a merge always makes two characters or more.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from nnx_surgery.surgery.families.errors import CheckpointError
from nnx_surgery.surgery.storage.gguf_vocab_reader import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

SPECIAL_SCORE = -1000.0
SPACE_PIECE = "\u2581"
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
SPECIAL_NAMES = ("bos", "eos", "unk", "pad")  # tokenizer_config's `<name>_token`, config.json's `<name>_token_id`


@dataclasses.dataclass(frozen=True)
class GGUFVocabulary:
    """What llama.cpp's `tokenizer.ggml.*` keys hold: per id a token, score and type; special ids by name (bos,
    eos, unk, pad); whether BOS/EOS are added and the text gets a leading space; the chat template, if any."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None


def read_vocabulary(folder: str, vocab_size: int) -> GGUFVocabulary:
    """The SentencePiece vocabulary of `folder`'s tokenizer.json (with tokenizer_config.json, config.json and
    chat_template.jinja for special tokens and flags), `vocab_size` entries long."""
    where = os.path.join(folder, "tokenizer.json")
    tokenizer = _read_json(where, required=True)
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback") or not isinstance(model.get("vocab"), dict):
        raise CheckpointError(f"{where}: a {model.get('type')!r} tokenizer (byte_fallback="
                              f"{model.get('byte_fallback')}); only a SentencePiece-style BPE with byte fallback "
                              "(Gemma's) can be written as llama.cpp's 'llama' vocabulary.")
    tokenizer_config = _read_json(os.path.join(folder, "tokenizer_config.json"))
    tokens, types = _tokens_and_types(model, tokenizer.get("added_tokens") or [], vocab_size, where)
    by_text = {token: index for index, token in enumerate(tokens)}
    for index, kind in enumerate(types):  # added tokens may be named with "▁" where the table now has spaces
        if kind == USER_DEFINED:
            by_text.setdefault(tokens[index].replace(" ", SPACE_PIECE), index)
    special_ids = _special_ids(tokenizer_config, _read_json(os.path.join(folder, "config.json")), by_text,
                               vocab_size, folder)
    add_bos, add_eos = _add_flags(tokenizer_config, tokenizer.get("post_processor"), tokens, special_ids)
    return GGUFVocabulary(tokens, _scores(tokens, types, model.get("merges") or []), types, special_ids, add_bos, add_eos,
                      _adds_space_prefix(tokenizer), _chat_template(tokenizer_config, folder))


def _read_json(path: str, required: bool = False) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        if required:
            raise CheckpointError(f"{path}: not found; a GGUF needs the model's tokenizer (save it beside the "
                                  "weights, e.g. `tokenizer.save_pretrained(folder)`).") from None
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err}).") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(data).__name__}.")
    return data


def _tokens_and_types(model: dict, added: list, vocab_size: int, where: str) -> tuple[list[str], list[int]]:
    tokens: list[str | None] = [None] * vocab_size
    types = [NORMAL] * vocab_size
    for text, index in model["vocab"].items():
        _check_id(index, vocab_size, f"vocabulary entry {text!r}", where)
        tokens[index] = text
        if BYTE_PIECE.fullmatch(text):
            types[index] = BYTE
        elif len(text) > 1 and not text.strip(SPACE_PIECE):
            types[index] = USER_DEFINED
    for entry in added:
        index, text = entry.get("id"), entry.get("content")
        _check_id(index, vocab_size, f"added token {text!r}", where)
        tokens[index] = text
        types[index] = CONTROL if entry.get("special") else USER_DEFINED
    unknown = model.get("unk_token")
    if unknown in model["vocab"] and types[model["vocab"][unknown]] == NORMAL:
        types[model["vocab"][unknown]] = UNKNOWN
    names: list[str] = []
    for index, text in enumerate(tokens):
        if text is None:
            text, types[index] = f"[PAD{index}]", UNUSED
        elif types[index] == USER_DEFINED:
            text = text.replace(SPACE_PIECE, " ")
        names.append(text)
    return names, types


def _check_id(index: Any, vocab_size: int, what: str, where: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < vocab_size:
        raise CheckpointError(f"{where}: {what} has id {index!r}, outside config.json's vocab_size={vocab_size} "
                              "(the embedding's rows); the tokenizer does not belong to these weights (trim or "
                              "save it with the model).")


def _scores(tokens: list[str], types: list[int], merges: list) -> list[float]:
    """SentencePiece scores that rank the NORMAL tokens as the merges do (see the module docstring)."""
    normal = {token: index for index, token in enumerate(tokens) if types[index] == NORMAL}
    order: dict[int, None] = {}  # insertion-ordered set of ids
    for merge in merges:
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if len(pair) == 2 and (index := normal.get(pair[0] + pair[1])) is not None:
            order.setdefault(index)
    order.update(dict.fromkeys(sorted(normal.values())))
    scores = [0.0 if kind == BYTE else SPECIAL_SCORE for kind in types]
    for rank, index in enumerate(order):
        scores[index] = -float(rank)
    return scores


def _special_ids(tokenizer_config: dict, config: dict, by_text: dict[str, int], vocab_size: int,
                 folder: str) -> dict[str, int]:
    """bos/eos/unk/pad ids: tokenizer_config.json's tokens (what the tokenizer uses), else config.json's ids."""
    found = {}
    for name in SPECIAL_NAMES:
        entry = tokenizer_config.get(f"{name}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(text, str) and text in by_text:
            found[name] = by_text[text]
            continue
        value = config.get(f"{name}_token_id")
        value = value[0] if isinstance(value, list) and value else value  # Gemma 3 lists [<eos>, <end_of_turn>]
        if isinstance(value, int) and not isinstance(value, bool):
            if not 0 <= value < vocab_size:
                raise CheckpointError(f"{folder}/config.json: {name}_token_id={value} is outside the vocabulary "
                                      f"of {vocab_size} tokens.")
            found[name] = value
    return found


def _add_flags(tokenizer_config: dict, post_processor: Any, tokens: list[str],
               special_ids: dict[str, int]) -> tuple[bool, bool]:
    """add_bos/add_eos as tokenizer_config.json states them (transformers rebuilds its template from these), else
    as tokenizer.json's template applies them; BOS is added by default, as llama.cpp and transformers do for
    SentencePiece vocabularies."""
    first, last = _template_ends(post_processor)
    bos = special_ids.get("bos")
    eos = special_ids.get("eos")
    add_bos = tokenizer_config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = first == tokens[bos] if first is not None and bos is not None else post_processor is None
    add_eos = tokenizer_config.get("add_eos_token")
    if not isinstance(add_eos, bool):
        add_eos = last is not None and eos is not None and last == tokens[eos]
    return add_bos, add_eos


def _template_ends(post_processor: Any) -> tuple[str | None, str | None]:
    """The special tokens a TemplateProcessing puts before and after a single sequence."""
    if not isinstance(post_processor, dict):
        return None, None
    for processor in post_processor.get("processors") or [post_processor]:
        if processor.get("type") == "TemplateProcessing":
            single = processor.get("single") or []
            ends = [item.get("SpecialToken", {}).get("id") if isinstance(item, dict) else None
                    for item in (single[:1] + single[-1:])]
            return (ends[0], ends[-1]) if len(single) > 1 else (None, None)
    return None, None


def _adds_space_prefix(tokenizer: dict) -> bool:
    """Whether the tokenizer puts "▁" before the text (a Prepend normaliser or a prepending Metaspace)."""
    parts = []
    for key in ("normalizer", "pre_tokenizer"):
        step = tokenizer.get(key) or {}
        parts += step.get("normalizers") or step.get("pretokenizers") or [step]
    return any(p.get("type") == "Prepend" and p.get("prepend") == SPACE_PIECE
               or p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
               for p in parts if isinstance(p, dict))


def _chat_template(tokenizer_config: dict, folder: str) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, str) and template:
        return template
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read() or None
    return None


def add_to_writer(writer, vocab: GGUFVocabulary) -> None:
    """The `tokenizer.ggml.*` keys, in the converter's order and spelling."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    for name, method in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                         ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if name in vocab.special_ids:
            method(vocab.special_ids[name])
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_sep_token(False)
    writer.add_add_eos_token(vocab.add_eos)
    writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)


__all__ = ["GGUFVocabulary", "read_vocabulary", "add_to_writer"]
