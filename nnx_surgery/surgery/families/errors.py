"""The error a checkpoint or folder on disk raises, in a module of its own so the lowest-level modules
(atomic.py, safetensors_stream.py) can share it."""


class CheckpointError(ValueError):
    """A checkpoint on disk that cannot be read as asked: says which file and tensor, and what was expected."""


__all__ = ["CheckpointError"]
