"""Hugging Face tokenizer files from a GGUF vocabulary, built the way transformers builds Gemma's.

A GGUF carries no `tokenizer.json`: llama.cpp stores the SentencePiece vocabulary as metadata (`tokenizer.ggml.*`:
tokens, scores, token types, special-token ids, add_bos/add_eos). transformers (`AutoTokenizer.from_pretrained(dir,
gguf_file=name)`, its `gemma_tokenizer` in integrations/gguf) turns that into a byte-fallback BPE, and this module
reproduces that tokenizer with the `tokenizers` library alone, so the ids are the same:

* tokens made only of spaces are stored as real spaces ("  ") but looked up as "▁▁": they are respelled first;
* the file has no merges for Gemma, so they are rebuilt from the vocabulary: every split of a token into two
  tokens is a merge, ranked by the token's position in the file (earlier = merged first), ties broken by the
  lengths of the two halves and then by the halves' ids;
* tokens typed CONTROL become special added tokens, USER_DEFINED ones (e.g. runs of newlines) plain added tokens,
  so both are matched whole;
* the post-processor prepends BOS (and appends EOS) as `tokenizer.ggml.add_bos_token` / `add_eos_token` say.
"""
from __future__ import annotations

from typing import Any

from .safetensors_stream import CheckpointError

# llama.cpp's SentencePiece token types (gguf.TokenType, without importing gguf with the package)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPECIAL_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
               "pad_token": "padding_token_id"}
MASK_TOKEN = "<mask>"  # GemmaTokenizer's mask token; no GGUF key names it
SPACE_PIECE = "\u2581"


def respelled_tokens(tokens: list[str]) -> list[str]:
    """Tokens of two or more real spaces under their SentencePiece spelling ("  " -> "▁▁")."""
    return [SPACE_PIECE * len(t) if " " in t and not t.strip() else t for t in tokens]


def gemma_merges(tokens: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The BPE vocabulary and merges a Gemma SentencePiece vocabulary implies (transformers' `generate_merges`
    with file positions as scores). A token listed twice keeps its last id, as a dict built in file order does."""
    vocab = {token: index for index, token in enumerate(tokens)}
    rank = {token: -index for index, token in enumerate(tokens)}  # earlier in the file = higher score
    merges: list[tuple[str, str, int]] = []
    for token, score in rank.items():
        local = []
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable: ties keep the order above
    return vocab, [(left, right) for left, right, _ in merges]


def special_tokens(metadata: dict[str, Any], tokens: list[str], where: str) -> dict[str, str]:
    """bos/eos/unk/pad token strings from the `tokenizer.ggml.*_token_id` keys present in the file."""
    found = {}
    for name, key in SPECIAL_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            continue
        if not 0 <= int(token_id) < len(tokens):
            raise CheckpointError(f"{where}: tokenizer.ggml.{key}={token_id} is outside the {len(tokens)}-token "
                                  "vocabulary; the file's tokenizer metadata is corrupt.")
        found[name] = tokens[int(token_id)]
    return found


def build_tokenizer(metadata: dict[str, Any], where: str):
    """The `tokenizers.Tokenizer` transformers builds from this GGUF metadata (SentencePiece vocabularies only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "llama":
        raise CheckpointError(f"{where}: tokenizer.ggml.model={kind!r}; only SentencePiece vocabularies ('llama', "
                              "what llama.cpp writes for Gemma) can be converted.")
    tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
    types = list(metadata.get("tokenizer.ggml.token_type") or [])
    if not tokens or len(types) not in (0, len(tokens)):
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens has {len(tokens)} entries and token_type "
                              f"{len(types)}; the vocabulary metadata is missing or corrupt.")
    special = special_tokens(metadata, tokens, where)
    vocab, merges = gemma_merges(respelled_tokens(tokens))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, dropout=None, byte_fallback=True,
                                     unk_token=special.get("unk_token", "<unk>")))
    tokenizer.normalizer = normalizers.Replace(" ", SPACE_PIECE)
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    named = [special[k] for k in ("unk_token", "bos_token", "eos_token", "pad_token") if k in special]
    named += [MASK_TOKEN] if MASK_TOKEN in vocab else []
    control = [t for t, kind in zip(tokens, types) if kind == CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in dict.fromkeys(named + control)])
    user = [t for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    tokenizer.post_processor = post_processor(processors, special, vocab, add_bos(metadata),
                                              bool(metadata.get("tokenizer.ggml.add_eos_token", False)))
    return tokenizer


def add_bos(metadata: dict[str, Any]) -> bool:
    """llama.cpp prepends BOS to SentencePiece vocabularies unless the file says otherwise (so does transformers)."""
    return bool(metadata.get("tokenizer.ggml.add_bos_token", True))


def post_processor(processors, special: dict[str, str], vocab: dict[str, int], bos: bool, eos: bool):
    bos_token, eos_token = special.get("bos_token"), special.get("eos_token")
    bos, eos = bos and bos_token is not None, eos and eos_token is not None
    single = f"{bos_token + ':0 ' if bos else ''}$A:0{' ' + eos_token + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos_token + ':1' if bos else ''} $B:1{' ' + eos_token + ':1' if eos else ''}"
    ids = [(bos_token, vocab[bos_token])] if bos else []
    ids += [(eos_token, vocab[eos_token])] if eos else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)


def tokenizer_configs(metadata: dict[str, Any], tokens: list[str], where: str) -> tuple[dict, dict]:
    """tokenizer_config.json and special_tokens_map.json for the files transformers and distill read."""
    special = special_tokens(metadata, tokens, where)
    if MASK_TOKEN in tokens:
        special["mask_token"] = MASK_TOKEN
    config = {"tokenizer_class": "GemmaTokenizer", "backend": "tokenizers", **special,
              "add_bos_token": add_bos(metadata),
              "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
              "clean_up_tokenization_spaces": False}
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config, special
