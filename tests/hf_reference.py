"""Tiny Gemma checkpoints made with transformers (the reference nobody here wrote), and helpers to compare."""
from __future__ import annotations

import numpy as np
import torch

FAMILIES = ("gemma", "gemma2", "gemma3_text")
# The Llama family: "llama" (GQA, untied head, Llama 3.1 RoPE scaling, explicit head_dim), "mistral" (a sliding
# window on every layer), "qwen2" (q/k/v biases, sliding layers from max_window_layers on), "llama_tied" (tied
# head, linear RoPE, attention_bias on q/k/v and o_proj).
LLAMA_FAMILIES = ("llama", "mistral", "qwen2", "llama_tied")


def tiny_config(family: str, **overrides):
    """Odd shapes on purpose: head_dim != hidden/heads, GQA, query_pre_attn_scalar != head_dim, small windows."""
    import transformers

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if family in LLAMA_FAMILIES:
        cls, extra = _llama_config(family, common)
    elif family == "gemma":
        cls, extra = transformers.GemmaConfig, dict(hidden_act="gelu_pytorch_tanh")
    elif family == "gemma2":
        cls, extra = transformers.Gemma2Config, dict(query_pre_attn_scalar=20, sliding_window=5,
                                                      attn_logit_softcapping=3.0, final_logit_softcapping=4.0)
    else:
        cls = transformers.Gemma3TextConfig
        extra = dict(query_pre_attn_scalar=20, sliding_window=5, sliding_window_pattern=3,
                     rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                         "rope_theta": 1000000.0}})
    extra.update(overrides)
    return cls(**{**common, **extra})


def _llama_config(family: str, common: dict):
    import transformers

    common.update(tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig, dict(rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    if family == "llama_tied":
        return transformers.LlamaConfig, dict(tie_word_embeddings=True, attention_bias=True, head_dim=8,
                                              rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 10000.0})
    if family == "mistral":
        return transformers.MistralConfig, dict(sliding_window=5, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 10000.0})
    common.pop("head_dim")  # Qwen2 derives it: 32 / 4 = 8
    return transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=5, max_window_layers=2)


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A transformers model with random weights everywhere, norms included (they start at zero otherwise)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.15
            param.copy_(torch.randn_like(param) * scale)
    return model.eval()


def save_hf(model, folder, **kwargs) -> str:
    model.save_pretrained(folder, **kwargs)
    return str(folder)


def hf_logits(folder_or_model, input_ids: np.ndarray, dtype=torch.float32, attention_mask=None) -> np.ndarray:
    import transformers

    if isinstance(folder_or_model, str):
        model = transformers.AutoModelForCausalLM.from_pretrained(folder_or_model, dtype=dtype).eval()
    else:
        model = folder_or_model
    with torch.no_grad():
        kwargs = {}
        if attention_mask is not None:
            kwargs["attention_mask"] = torch.tensor(attention_mask)
        out = model(torch.tensor(input_ids, dtype=torch.long), use_cache=False, **kwargs)
    return out.logits.float().numpy()


def load_with_info(folder: str, dtype=torch.float32):
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    return model.eval(), info


def assert_clean_loading(info) -> None:
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(key), f"{key}: {info.get(key)}"


def sample_ids(batch: int = 2, length: int = 13, vocab: int = 96, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length)).astype(np.int32)


# ------------------------------------------------------------------------------------------------ additions
def randomize_(model, seed: int = 0):
    """Random weights everywhere (norms included: they start at zero, which would hide `(1 + w)` bugs)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * (0.3 if "norm" in name else 0.15))
    return model.eval()


def make_hf_multimodal(seed: int = 0, **text_overrides):
    """A tiny Gemma3ForConditionalGeneration: the 4B+ layout (`language_model.model.*`, vision tower, projector,
    model_type "gemma3" with a text_config)."""
    import transformers

    text = tiny_config("gemma3_text", **text_overrides).to_dict()
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return randomize_(transformers.Gemma3ForConditionalGeneration(config), seed)


def hf_forward(model, input_ids: np.ndarray, attention_mask=None, *, hidden_states: bool = False,
               attentions: bool = False):
    """transformers' output object (logits, hidden_states, attentions) as float32 numpy arrays."""
    kwargs = {} if attention_mask is None else {"attention_mask": torch.tensor(np.asarray(attention_mask))}
    with torch.no_grad():
        out = model(torch.tensor(np.asarray(input_ids), dtype=torch.long), use_cache=False,
                    output_hidden_states=hidden_states, output_attentions=attentions, **kwargs)

    def numpy(x):
        return None if x is None else tuple(t.float().numpy() for t in x)

    return dict(logits=out.logits.float().numpy(), hidden_states=numpy(out.hidden_states),
                attentions=numpy(out.attentions))


def save_tiny_tokenizer(folder: str, vocab_size: int = 96) -> None:
    """A WordLevel tokenizer (tokens "t0".."tN", whitespace split) saved the transformers way."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    vocab.update({f"t{i}": i for i in range(4, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                      bos_token="<bos>", unk_token="<unk>")
    wrapped.save_pretrained(folder)


def max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def safetensors_data_start(path: str) -> int:
    """Where tensor data starts in a safetensors file: 8 + the header length."""
    import struct

    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def rewrite_unaligned(folder) -> list[int]:
    """Rewrite every safetensors file of `folder` with the safetensors library's own writer (header padded to 8
    bytes, as transformers and the Hub write files), choosing the metadata so that the tensor data does *not* start
    64-byte aligned (7 Hub files in 8 are like that). Returns each file's data start."""
    import os

    import ml_dtypes  # noqa: F401  (bfloat16 for safetensors.numpy)
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    starts = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(folder, name)
        with safe_open(path, "numpy") as f:
            metadata = f.metadata() or {"format": "pt"}
        tensors = load_file(path)
        for pad in range(16):
            save_file(tensors, path, metadata={**metadata, **({"pad": "x" * pad} if pad else {})})
            if safetensors_data_start(path) % 64:
                break
        starts.append(safetensors_data_start(path))
    return starts
