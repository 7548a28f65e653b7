"""A byte-level tokenizer for offline demos and tests, in the `tokenizers` format transformers loads.

Ids follow Gemma's special-token convention, so a student trained with it has the usual config token ids:

    <pad>=0  <eos>=1  <bos>=2  <unk>=3  byte b -> 4 + b    (vocab size 260)

Bytes are mapped to printable characters with the GPT-2 byte-level alphabet (`pre_tokenizers.ByteLevel`) and
a merge-free BPE model, so every UTF-8 string round-trips exactly. Encoding with special tokens prepends <bos>,
as Gemma's tokenizer does.
"""
from __future__ import annotations

import json
import os

SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")
PAD_ID, EOS_ID, BOS_ID, UNK_ID = range(4)
BYTE_OFFSET = len(SPECIALS)
VOCAB_SIZE = BYTE_OFFSET + 256


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what `pre_tokenizers.ByteLevel` emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def byte_tokenizer(path: str | os.PathLike | None = None):
    """The byte tokenizer as a `tokenizers.Tokenizer`; with `path` (a folder or tokenizer.json), load that file."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if path is not None:
        path = os.fspath(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        return Tokenizer.from_file(file)
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({char: BYTE_OFFSET + byte for byte, char in _byte_alphabet().items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)])
    return tokenizer


def save_byte_tokenizer(folder: str | os.PathLike) -> str:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `folder`; returns it.

    `transformers.AutoTokenizer.from_pretrained(folder)` then gives a fast tokenizer with the same ids."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    byte_tokenizer().save(os.path.join(folder, "tokenizer.json"))
    special = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": True,
              "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}
    for name, data in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        with open(os.path.join(folder, name), "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    return folder
