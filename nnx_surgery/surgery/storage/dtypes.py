"""Model dtypes by name: what `dtype=` accepts everywhere, and the safetensors codes of stored tensors."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .safetensors_stream import dtype_code

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16, "half": jnp.float16}
STORED_DTYPES = {"F32": jnp.float32, "BF16": jnp.bfloat16, "F16": jnp.float16}


def resolve_dtype(dtype):
    """None / "auto" -> None (keep the checkpoint's dtype); a name, numpy, jnp or torch dtype -> a numpy dtype
    among float32, bfloat16, float16. Anything else is a ValueError naming the accepted values."""
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        return None
    name = dtype.lower() if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name in DTYPES:
        return np.dtype(DTYPES[name])
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in {np.dtype(v) for v in STORED_DTYPES.values()}:
        raise ValueError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or float16 (or None / 'auto' "
                         "for the checkpoint's own dtype).")
    return resolved


def torch_dtype_name(dtype) -> str:
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[dtype_code(dtype)]


__all__ = ["DTYPES", "STORED_DTYPES", "resolve_dtype", "torch_dtype_name"]
