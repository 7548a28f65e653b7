"""Host buffers that loading reads tensors into: 64-byte aligned (XLA:CPU adopts them without copying), and for
large tensors private anonymous mappings that the reader thread pre-faults, piece by piece, just before it fills
them.

Where a checkpoint's tensor data is not 64-byte aligned in its file (files written by the safetensors library,
transformers or the Hub pad the header to 8 bytes only, so 7 files in 8), loading must copy every byte into fresh
memory, and faulting that memory in costs as much as the copy. Pre-faulting each piece with one
MADV_POPULATE_WRITE call (Linux 5.14) in the thread that then reads it spreads the faults over both reader threads
instead of taking them one 4 KiB page at a time inside the kernel's copy. Every buffer is created before the first
read (see block_reads): creating a mapping waits for the address-space lock that pre-faulting holds.

Huge pages are *not* asked for by default (`HUGE_PAGES`), and are refused where numpy would ask for them (it
advises MADV_HUGEPAGE on every large array): on a VM with free-page reporting to the host, faulting a model in
as 2 MiB pages was slower than in 4 KiB pages, and less predictable (figures in bench/NOTES.md).
Where the kernel lacks an advice (not Linux, Linux < 5.14), the buffers simply fault on first write.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np

ALIGN = 64  # XLA:CPU uses a host buffer without copying it only when its address is 64-byte aligned
HUGE_PAGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) transparent huge page size
HUGE_BUFFER_MIN_BYTES = 4 << 20  # smaller tensors come from numpy's allocator (a mapping each would waste pages)
HUGE_PAGES = False  # True: MADV_HUGEPAGE on the whole 2 MiB extents of large buffers (see above)
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault the range in writable, in one call; Python's mmap names it from 3.12


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts 64-byte aligned (numpy's allocator)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(block: np.ndarray, dtype=None) -> np.ndarray:
    """`block` in `dtype` (default: its own), C-contiguous and 64-byte aligned: `block` itself when it already is,
    else one copy."""
    dtype = np.dtype(block.dtype if dtype is None else dtype)
    if block.dtype == dtype and block.flags.c_contiguous and block.ctypes.data % ALIGN == 0:
        return block
    out = aligned_empty(block.shape, dtype)
    out[...] = block
    return out


def host_buffer(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised 64-byte-aligned array to read a tensor into: for `HUGE_BUFFER_MIN_BYTES` and more, a
    private anonymous mapping of its own that starts on a 2 MiB boundary (call `prefault` on each part before
    filling it); smaller, `aligned_empty`. The mapping is unmapped when the last array viewing it goes."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < HUGE_BUFFER_MIN_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return aligned_empty(shape, dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE  # a multiple of the page size: mappings start on a page
    huge = nbytes - nbytes % HUGE_PAGE
    try:  # 4 KiB pages (also where THP is "always"); huge pages on whole extents only, when asked for: one over the
        # tail would add up to 2 MiB of resident memory per tensor
        region.madvise(mmap.MADV_NOHUGEPAGE)
        if HUGE_PAGES and huge:
            region.madvise(mmap.MADV_HUGEPAGE, start, huge)
    except (AttributeError, OSError):
        pass
    return whole[start:start + nbytes].view(dtype).reshape(shape)


def _libc_madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)  # CDLL calls release the GIL
        function = libc.madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


_MADVISE = _libc_madvise()
_POPULATE_WORKS = [True]  # set False at the first EINVAL (kernel without MADV_POPULATE_WRITE): stop asking


def prefault(array: np.ndarray) -> None:
    """Fault in the pages under `array` (contiguous) writable, in one system call, before it is filled; a no-op
    where the kernel cannot. Pages outside `array` that share its first or last page are faulted too (harmless:
    they belong to the same buffer or to memory already resident)."""
    if _MADVISE is None or not _POPULATE_WORKS[0] or array.nbytes == 0:
        return
    start = array.ctypes.data
    first = start - start % mmap.PAGESIZE
    if _MADVISE(first, start + array.nbytes - first, MADV_POPULATE_WRITE) != 0:
        if ctypes.get_errno() == 22:  # EINVAL: not supported by this kernel
            _POPULATE_WORKS[0] = False
