"""The vocabulary axis: which of the teacher's tokenizer pieces a student keeps (`StudentSpec(vocab_size=N)`).

In small models the embedding is most of the parameters, and a student for one domain uses a small part of a
large vocabulary. The kept pieces are chosen from the teacher's `tokenizer.json` (a BPE model) and the
calibration token ids:

    1. every special token: the tokenizer's special added tokens (bos, eos, pad, unk, mask, <start_of_turn>, ...),
       the tokens its configs name, the post-processor's tokens and every `*_token_id` of config.json; except
       reserved placeholders (`<unusedN>`, `<|reserved_special_token_N|>`), which the teacher never learnt;
    2. the byte pieces: `<0x00>`..`<0xFF>` of a byte-fallback BPE (Gemma, Llama 2, Mistral), or the 256 symbols of
       the byte-level alphabet of a byte-level BPE (Llama 3, Qwen2). Any text can be spelt with them, so any text
       still tokenizes, and decodes back to itself;
    3. the pieces most frequent in the calibration data, then pieces it never saw, earliest merge first (BPE learns
       merges in order of frequency in its own training data);
    each with its merge parents, recursively. BPE forms a piece by one merge of two pieces (the one it makes when
    it runs on the piece's own characters); both are kept. When every piece of a text, and so every intermediate
    piece, is kept, the trimmed tokenizer (its merges restricted to kept pieces, in the teacher's order) makes the
    teacher's merges and no others, so that text tokenizes exactly as before.

A piece whose missing parents do not fit in what is left of N is skipped and the next one tried: the least
frequent calibration pieces are the ones dropped, and the plan's `scores["vocab"]` says how many there were and
what share of the calibration tokens they covered. Kept ids are sorted, so student id i is teacher id kept[i].
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Iterable

import numpy as np

from nnx_surgery.surgery.modeling.model_config import ModelConfig
from nnx_surgery.surgery.plans.student_spec import SpecError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
RESERVED = re.compile(r"<unused\d+>|<\|reserved_special_token_\d+\|>")
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "cls_token", "sep_token")
SPECIAL_LISTS = ("additional_special_tokens", "extra_special_tokens")


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map (what `pre_tokenizers.ByteLevel` emits), in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def config_token_ids(config_dict: dict[str, Any]) -> dict[str, list[int]]:
    """The token ids a config.json (or generation_config.json) names: `*_token_id` keys, as lists."""
    found = {}
    for key, value in config_dict.items():
        if not key.endswith("_token_id") or value is None:
            continue
        values = value if isinstance(value, list) else [value]
        if all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            found[key] = values
    return found


def remap_token_ids(config_dict: dict[str, Any], new_id: dict[int, int]) -> dict[str, Any]:
    """A copy with every `*_token_id` in student ids (`new_id`: teacher id -> student id). An id the student does
    not have (e.g. one past the teacher's embedding, which no student can keep) becomes None, or is dropped from a
    list."""
    out = dict(config_dict)
    for key, values in config_token_ids(config_dict).items():
        mapped = [new_id[v] for v in values if v in new_id]
        if isinstance(config_dict[key], list):
            out[key] = mapped
        else:
            out[key] = mapped[0] if mapped else None
    return out


def with_vocabulary(config: ModelConfig, kept: list[int]) -> ModelConfig:
    """The student ModelConfig `config` with only the teacher ids `kept` (vocab_size, remapped special ids)."""
    new_id = {teacher: student for student, teacher in enumerate(kept)}
    return config.replace(vocab_size=len(kept), raw=remap_token_ids(config.raw, new_id))


# ------------------------------------------------------------------------------------------------ the tokenizer
@dataclasses.dataclass
class TeacherTokenizer:
    """A teacher's tokenizer.json (and its configs) as read for trimming. `pieces`: teacher id -> piece (the
    model's vocabulary and the added tokens); `ranks`: merge (left, right) -> rank."""

    data: dict[str, Any]
    configs: dict[str, dict[str, Any]]
    where: str
    sha256: str

    def __post_init__(self) -> None:
        model = self.data.get("model") or {}
        if model.get("type") != "BPE":
            raise SpecError(f"{self.where}: vocabulary trimming needs a BPE tokenizer (Gemma, Llama, Mistral, Qwen2), "
                            f"not {model.get('type')!r}; drop vocab_size from the spec.")
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("dropout"):
            raise SpecError(f"{self.where}: BPE with a subword prefix, end-of-word suffix or dropout is not supported "
                            "by vocabulary trimming; drop vocab_size from the spec.")
        self.pieces: dict[int, str] = {int(i): piece for piece, i in model["vocab"].items()}
        self.pieces.update({int(t["id"]): t["content"] for t in self.data.get("added_tokens") or []})
        self.ids: dict[str, int] = {piece: i for i, piece in self.pieces.items()}
        self.merges = [_merge_pair(m, self.where) for m in model.get("merges") or []]
        self.ranks = {pair: rank for rank, pair in enumerate(self.merges)}
        # special added tokens are matched whole before BPE runs: BPE never forms them, they need no parents
        self.matched_whole = {int(t["id"]) for t in self.data.get("added_tokens") or [] if t.get("special")}
        self._parents: dict[str, tuple[str, str] | None] = {}

    @classmethod
    def read(cls, path: str | os.PathLike) -> "TeacherTokenizer":
        """From a folder holding tokenizer.json (its tokenizer_config.json and special_tokens_map.json are read
        too when present) or from the tokenizer.json file itself."""
        path = os.fspath(path)
        file = os.path.join(path, TOKENIZER_FILE) if os.path.isdir(path) else path
        try:
            with open(file, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raise SpecError(f"{file}: not found; vocabulary trimming reads the teacher's fast tokenizer "
                            f"(tokenizer.json). Pass tokenizer= a folder that has it.") from None
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SpecError(f"{file}: not a valid tokenizer.json ({err}).") from None
        configs = {}
        for name in CONFIG_FILES:
            sibling = os.path.join(os.path.dirname(file), name)
            if os.path.isfile(sibling):
                try:
                    with open(sibling, encoding="utf-8") as f:
                        configs[name] = json.load(f)
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise SpecError(f"{sibling}: not valid JSON ({err}); fix or remove it.") from None
        return cls(data, configs, file, hashlib.sha256(raw).hexdigest()[:16])

    # ---------------------------------------------------------------------------------------------- pieces
    def byte_pieces(self) -> tuple[str, list[int]]:
        """(kind, ids): "byte_fallback" and the <0xNN> pieces, or "byte_level" and the byte-level alphabet."""
        if self.data["model"].get("byte_fallback"):
            kind, names = "byte_fallback", [f"<0x{b:02X}>" for b in range(256)]
        elif _has_byte_level(self.data.get("pre_tokenizer")):
            kind, names = "byte_level", byte_level_alphabet()
        else:
            raise SpecError(f"{self.where}: this BPE has neither byte fallback nor a byte-level alphabet, so a "
                            "trimmed vocabulary could not spell every text; drop vocab_size from the spec.")
        missing = [name for name in names if name not in self.ids]
        if missing:
            raise SpecError(f"{self.where}: a {kind} tokenizer without the byte piece(s) {missing[:4]}; a trimmed "
                            "vocabulary could not spell every text. Drop vocab_size from the spec.")
        return kind, [self.ids[name] for name in names]

    def special_ids(self) -> tuple[set[int], int]:
        """(ids every student keeps, number of reserved placeholders left out)."""
        named: set[str] = set()
        for config in self.configs.values():
            named.update(_token_content(config.get(key)) for key in NAMED_SPECIALS)
            for key in SPECIAL_LISTS:
                values = config.get(key) or []
                named.update(_token_content(v) for v in (values.values() if isinstance(values, dict) else values))
        named.add(self.data["model"].get("unk_token"))
        named.update(_processor_tokens(self.data.get("post_processor")))
        named.update(t["content"] for t in self.data.get("added_tokens") or [] if t.get("special"))
        reserved = {piece for piece in named if isinstance(piece, str) and RESERVED.fullmatch(piece)}
        return {self.ids[p] for p in named - reserved if p in self.ids}, len(reserved)

    def reserved_ids(self) -> set[int]:
        return {i for i, piece in self.pieces.items() if RESERVED.fullmatch(piece)}

    def parents(self, piece: str) -> tuple[str, str] | None:
        """The two pieces BPE joins last when it forms `piece` from its characters (None: a single character, or
        a piece BPE never forms, which only the added-token matcher can produce)."""
        if piece not in self._parents:
            symbols, last = list(piece), None
            while len(symbols) > 1:  # BPE: the lowest-ranked adjacent pair first, leftmost among equals
                found = [(self.ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
                found = [f for f in found if f[0] is not None]
                if not found:
                    break
                _, i = min(found)
                last = (symbols[i], symbols[i + 1])
                symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            self._parents[piece] = last if symbols == [piece] else None
        return self._parents[piece]

    def with_ancestors(self, token_id: int) -> set[int]:
        """`token_id` and every piece BPE forms on the way to it."""
        found, stack = set(), [token_id]
        while stack:
            current = stack.pop()
            if current in found:
                continue
            found.add(current)
            pair = None if current in self.matched_whole else self.parents(self.pieces[current])
            if pair is not None:
                stack.extend(self.ids[p] for p in pair)
        return found

    def merge_order(self, size: int) -> np.ndarray:
        """Per teacher id, the rank of the first merge that forms it (len(merges) for pieces no merge forms)."""
        order = np.full(size, len(self.merges), np.int64)
        for rank in range(len(self.merges) - 1, -1, -1):
            left, right = self.merges[rank]
            token_id = self.ids.get(left + right)
            if token_id is not None and token_id < size:
                order[token_id] = rank
        return order


# ------------------------------------------------------------------------------------------------ choosing
def calibration_counts(batches: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """How often each teacher id occurs in the calibration batches."""
    ids = np.concatenate([np.asarray(b).reshape(-1) for b in batches]).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise SpecError(f"calibration holds token id {int(ids.max() if ids.max() >= vocab_size else ids.min())}, "
                        f"outside the teacher's vocabulary [0, {vocab_size}); tokenize it with the teacher's "
                        "tokenizer.")
    return np.bincount(ids, minlength=vocab_size)


def check_vocab_size(tokenizer: TeacherTokenizer, config: ModelConfig,
                     size: int) -> tuple[str, set[int], int, set[int]]:
    """Raise a SpecError when `size` pieces cannot hold what every student keeps (the special tokens and the 256
    byte pieces); else (byte-piece kind, special ids, reserved placeholders left out, the kept-by-all ids)."""
    kind, byte_ids = tokenizer.byte_pieces()
    specials, reserved = tokenizer.special_ids()
    specials |= {i for ids in config_token_ids(config.raw).values() for i in ids}
    forced = {i for i in specials | set(byte_ids) if i < config.vocab_size}
    if len(forced) > size:
        raise SpecError(f"vocab_size={size} is smaller than the {len(forced)} pieces every student keeps "
                        f"({len(forced & specials)} special tokens and 256 byte pieces, which let any text "
                        f"round-trip); use vocab_size >= {len(forced)}.")
    return kind, specials, reserved, forced


def choose_vocabulary(tokenizer: TeacherTokenizer, config: ModelConfig, counts: np.ndarray,
                      size: int) -> tuple[list[int], dict[str, Any]]:
    """(kept teacher ids, sorted; the record stored as the plan's scores["vocab"]) for a student of `size` pieces
    of the teacher `config` (a ModelConfig), from calibration `counts` (per teacher id). Module docstring."""
    limit = config.vocab_size
    kind, specials, reserved, forced = check_vocab_size(tokenizer, config, size)
    kept = set().union(*(tokenizer.with_ancestors(i) for i in forced))
    candidates = np.asarray(sorted(set(i for i in tokenizer.pieces if i < limit) - kept - tokenizer.reserved_ids()),
                            np.int64)
    birth = tokenizer.merge_order(limit)[candidates]
    order = candidates[np.lexsort((candidates, birth, -counts[candidates]))]
    chosen = set()  # pieces kept at their own rank (the others came in as merge parents)
    for token_id in order.tolist():
        if len(kept) >= size:
            break
        if token_id in kept:
            continue
        needed = tokenizer.with_ancestors(token_id) - kept
        if any(i >= limit for i in needed) or len(kept) + len(needed) > size:
            continue
        kept |= needed
        chosen.add(token_id)
    return sorted(kept), _record(kind, forced, specials, reserved, kept, chosen, counts, tokenizer)


def _record(kind, forced, specials, reserved, kept, chosen, counts, tokenizer) -> dict[str, Any]:
    seen = set(np.flatnonzero(counts).tolist())
    seen_kept = sorted(seen & kept)
    total = int(counts.sum())
    return {"tokenizer": kind, "tokenizer_sha256": tokenizer.sha256, "kept": len(kept),
            "special": len(forced & specials), "bytes": len(forced - specials), "reserved_left_out": reserved,
            "calibration_tokens": total, "calibration_pieces": len(seen), "calibration_pieces_kept": len(seen_kept),
            "calibration_pieces_dropped": len(seen - kept),
            "calibration_coverage": float(f"{counts[seen_kept].sum() / max(total, 1):.6g}"),
            "unseen_pieces": len(kept - seen - forced), "merge_parents": len(kept - chosen - forced)}


def describe_vocab(record: dict[str, Any]) -> str:
    """One paragraph for the surgery report."""
    text = (f"vocab: {record['kept']:,} pieces kept: {record['special']} special, {record['bytes']} byte "
            f"({record['tokenizer']}), {record['calibration_pieces_kept']:,} of the {record['calibration_pieces']:,} "
            f"calibration pieces ({100 * record['calibration_coverage']:.2f}% of its tokens) and "
            f"{record['unseen_pieces']:,} it never saw; {record['merge_parents']:,} were kept as merge parents")
    if record["calibration_pieces_dropped"]:
        text += (f". {record['calibration_pieces_dropped']:,} least frequent calibration pieces were dropped to "
                 "fit (their text falls back to smaller pieces)")
    if record["reserved_left_out"]:
        text += f". {record['reserved_left_out']:,} reserved placeholder tokens were left out"
    return text + "."


# ------------------------------------------------------------------------------------------------ helpers
def _merge_pair(merge: Any, where: str) -> tuple[str, str]:
    parts = merge.split(" ") if isinstance(merge, str) else merge
    if not isinstance(parts, list) or len(parts) != 2:
        raise SpecError(f"{where}: merge {merge!r} is not a pair of pieces.")
    return parts[0], parts[1]


def _has_byte_level(pre_tokenizer: dict | None) -> bool:
    if not pre_tokenizer:
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers") or [])


def _token_content(value: Any) -> str | None:
    """A special token in a tokenizer config: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _processor_tokens(processor: dict | None) -> set[str]:
    """Tokens a post-processor inserts (TemplateProcessing, Bert/Roberta processing, Sequence of them)."""
    if not processor:
        return set()
    found = set()
    for name, entry in (processor.get("special_tokens") or {}).items():
        found.update(entry.get("tokens") or [name] if isinstance(entry, dict) else [name])
    for key in ("sep", "cls"):
        if isinstance(processor.get(key), list):
            found.add(processor[key][0])
    for inner in processor.get("processors") or []:
        found |= _processor_tokens(inner)
    return found
