"""Text samples shared by the tokenizer tests (GGUF import and export)."""


def mixed_text() -> str:
    """A few kilobytes of prose, Python source, unicode, whitespace runs and special-token look-alikes."""
    import json.decoder

    with open(json.decoder.__file__, encoding="utf-8") as f:
        code = f.read()[:3000]
    prose = ("The quick brown fox jumps over the lazy dog. Distillation transfers a teacher's knowledge to a "
             "smaller student; pruning removes heads, layers and MLP channels first. " * 3)
    unicode = ("Größenordnung, déjà vu, naïve café — «guillemets» ¿qué? 東京は日本の首都です。 Ελληνικά, "
               "русский текст, العربية, हिन्दी, 한국어. Emoji: 🚀🔥👩‍💻 ✓ ∑ ∫ √ ≠ ≤ ½ € ¥ \u00a0nbsp \u200bzwsp")
    whitespace = "a  b   c    d\t\te\n\n\nf   \n    indented\r\nwindows line    \n\n\n\n\n  trailing   "
    special = ("<bos> <eos> <start_of_turn>user\nhi<end_of_turn> [multimodal] <unused5> <pad> <0x41> "
               "@#$%^&*()_+{}|:\"<>?~`")
    return "\n\n".join([prose, code, unicode, whitespace, special])
