"""Export: a student written out for others to run: GGUF for llama.cpp (gguf_export.py, gguf_vocab_writer.py), the
Hugging Face Hub (hub.py) and the model card (model_card.py)."""
from nnx_surgery.export.gguf_export import export_gguf
from nnx_surgery.export.hub import HubError, push_to_hub
from nnx_surgery.export.model_card import write_model_card

__all__ = ["export_gguf", "HubError", "push_to_hub", "write_model_card"]
