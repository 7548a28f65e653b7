"""nnx-surgery: exact Gemma 1/2/3 in Flax NNX, and the surgery that turns a large one into a smaller one."""
from .config import ConfigError, GemmaConfig
from .model import Gemma, GemmaOutput, abstract_model, create_model
from .safetensors_io import CheckpointError
from .checkpoint import load_pretrained, save_pretrained, tensor_table

__all__ = ["ConfigError", "CheckpointError", "GemmaConfig", "Gemma", "GemmaOutput", "abstract_model",
           "create_model", "load_pretrained", "save_pretrained", "tensor_table"]
