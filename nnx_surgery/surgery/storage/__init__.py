"""I/O and formats: safetensors streaming, Hugging Face checkpoints, GGUF import and export,
dtypes, atomic publication, host buffers, multi-host writes, the Hub and model cards."""
