"""Export: a student written out for others to run: GGUF for llama.cpp (gguf_export.py, gguf_vocab_writer.py), the
Hugging Face Hub (hub.py) and the model card (model_card.py)."""
