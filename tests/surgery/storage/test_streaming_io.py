"""The streaming pieces under loading and surgery: ordered work-ahead, the pipelined safetensors writer, the
disk reader's row runs and column gathers (into `out` buffers), the host buffers loads read into, and loading
files whose data is not 64-byte aligned (as the safetensors library and the Hub write 7 files in 8)."""
from __future__ import annotations

import os
import threading

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from hf_reference import hf_logits, make_hf_model, max_abs_diff, rewrite_unaligned, sample_ids
from safetensors.numpy import load_file, save_file

import nnx_surgery.surgery.storage.block_reads as block_reads
import nnx_surgery.surgery.storage.host_buffers as host_buffers
from nnx_surgery.surgery import load_pretrained, save_pretrained
from nnx_surgery.surgery.storage.pipeline import work_ahead
from nnx_surgery.surgery.storage.tensor_readers import DiskReader, Reader, row_runs
from nnx_surgery.surgery.storage.safetensors_stream import (ALIGN, CheckpointError, PendingTensor, RowSlice,
                                                            open_safetensors, write_safetensors)


def test_work_ahead_keeps_order_and_bounds_what_is_in_flight():
    lock, alive, most = threading.Lock(), [0], [0]

    def work(i):
        with lock:
            alive[0] += 1
            most[0] = max(most[0], alive[0])
        return i * i

    seen = []
    for item, result in work_ahead(range(20), work, workers=2, depth=3):
        seen.append((item, result))
        with lock:
            alive[0] -= 1  # the caller is done with this result
    assert seen == [(i, i * i) for i in range(20)]
    assert most[0] <= 3 + 1  # `depth` ahead plus the one the caller holds


def test_work_ahead_raises_at_the_failing_items_turn_and_refuses_bad_depth():
    def work(i):
        if i == 3:
            raise KeyError(f"item {i}")
        return i

    got = []
    with pytest.raises(KeyError, match="item 3"):
        for item, _ in work_ahead(range(10), work, depth=2):
            got.append(item)
    assert got == [0, 1, 2]
    with pytest.raises(ValueError, match="depth >= 1"):
        next(work_ahead([1], work, depth=0))


def test_pipelined_writer_matches_safetensors_aligns_data_and_names_a_bad_tensor(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal((i + 3, 5)).astype(np.float32) for i in range(5)}
    arrays["b"] = rng.standard_normal((7,)).astype(ml_dtypes.bfloat16)
    tensors = [PendingTensor(name, a.shape, a.dtype, lambda a=a: a) for name, a in arrays.items()]
    write_safetensors(str(tmp_path / "ours.safetensors"), tensors)
    loaded = load_file(str(tmp_path / "ours.safetensors"))
    assert set(loaded) == set(arrays)
    with open_safetensors(str(tmp_path / "ours.safetensors")) as f:
        assert f.data_start % ALIGN == 0  # the header is padded so that mapped tensors can be adopted uncopied
    for name, a in arrays.items():
        assert loaded[name].dtype == a.dtype and np.array_equal(loaded[name].view(np.uint8), a.view(np.uint8))
    bad = tensors[:2] + [PendingTensor("wrong", (4, 4), np.dtype(np.float32), lambda: np.zeros((3, 4), np.float32))]
    with pytest.raises(CheckpointError, match="tensor wrong came out \\(3, 4\\), expected \\(4, 4\\)"):
        write_safetensors(str(tmp_path / "bad.safetensors"), bad)


def test_row_runs_cover_rows_in_order():
    assert row_runs(None, 10) == [(0, 10, None)]
    runs = row_runs(np.array([2, 3, 4, 9, 30, 31, 5]), 40)
    assert [(lo, hi) for lo, hi, _ in runs] == [(2, 10), (30, 32), (5, 6)]  # gap of 4 read through; 31 -> 5 breaks
    assert runs[0][2].tolist() == [0, 1, 2, 7] and runs[1][2] is None and runs[2][2] is None


@pytest.mark.parametrize("stored, wanted", [(np.float32, np.float32), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                                            (ml_dtypes.bfloat16, np.float32)])
def test_disk_reader_gathers_rows_and_columns_like_numpy(tmp_path, stored, wanted):
    rng = np.random.default_rng(1)
    matrix = rng.standard_normal((60, 24)).astype(stored)
    vector = rng.standard_normal(60).astype(stored)
    save_file({"model.m.weight": matrix, "model.v.weight": vector}, str(tmp_path / "model.safetensors"))
    read = DiskReader(str(tmp_path), wanted)
    assert isinstance(read, Reader)
    cases = [(None, None), (np.arange(5, 40), None), (np.array([0, 1, 2, 30, 31, 59, 4]), None),
             (None, np.arange(8, 16)), (rng.choice(60, 20, replace=False), np.array([5, 2, 23, 0])),
             (np.arange(60), rng.permutation(24)[:10]), (np.array([], np.int64), np.array([1, 2]))]
    for rows, cols in cases:
        want = matrix if rows is None else matrix[rows]
        want = (want if cols is None else want[:, cols]).astype(wanted)
        np.testing.assert_array_equal(read("model.m.weight", rows, cols), want)
        out = np.full(want.shape, 7, wanted)
        assert read("model.m.weight", rows, cols, out=out) is out
        np.testing.assert_array_equal(out, want)
        vec = (vector if rows is None else vector[rows]).astype(wanted)
        np.testing.assert_array_equal(read("model.v.weight", rows, None), vec)
    with pytest.raises(ValueError, match="out has shape"):
        read("model.m.weight", None, None, out=np.empty((60, 23), wanted))



@pytest.mark.parametrize("map_files", [True, False])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_loaded_parameters_are_the_buffers_the_file_was_read_into(tmp_path, monkeypatch, dtype, map_files):
    """On CPU, loading makes no second copy: XLA adopts as each parameter's device buffer either the file's own
    (copy-on-write mapped) pages or the 64-byte-aligned buffer the tensor was read or cast into."""
    hf = make_hf_model("gemma2", seed=2)
    hf.save_pretrained(tmp_path / "hf")  # transformers' writer: data aligned to 8 bytes, maybe not to 64
    save_pretrained(load_pretrained(tmp_path / "hf"), tmp_path / "ours")  # ours: data 64-byte aligned
    monkeypatch.setattr(block_reads, "MAP_FILES", map_files)
    allocate, view = block_reads.host_buffer, RowSlice.mapped_rows
    for folder in (tmp_path / "hf", tmp_path / "ours"):
        read_into, mapped = set(), set()

        def recording(shape, dtype):
            buffer = allocate(shape, dtype)
            read_into.add(buffer.ctypes.data)
            return buffer

        def recording_view(self, start, stop):
            rows = view(self, start, stop)
            mapped.add(rows.ctypes.data)
            return rows

        monkeypatch.setattr(block_reads, "host_buffer", recording)
        monkeypatch.setattr(RowSlice, "mapped_rows", recording_view)
        model = load_pretrained(folder, dtype=dtype)
        leaves = nnx.to_flat_state(nnx.state(model))
        buffers = {v[...].unsafe_buffer_pointer() for _, v in leaves}
        assert len(buffers) == len(read_into) + len(mapped) == len(leaves)
        assert buffers == read_into | mapped
        if folder.name == "ours" and dtype is None:  # same dtype and aligned: every tensor is the file's pages
            assert len(mapped) == (len(leaves) if map_files else 0)
        if dtype == "bfloat16":  # a cast cannot be a view of the file
            assert not mapped
        np.testing.assert_array_equal(np.asarray(model.layers[1].self_attn.q_proj.weight[...], np.float32),
                                      hf.model.layers[1].self_attn.q_proj.weight.detach().to(torch.bfloat16 if dtype
                                      else torch.float32).float().numpy().reshape(4, 12, 32))


def test_large_tensors_are_read_in_row_pieces_on_both_threads(tmp_path, monkeypatch):
    """Pieces of PIECE_BYTES (shrunk here) fill one buffer from several `preadv`s: the values are the file's."""
    hf = make_hf_model("gemma3_text", seed=4, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "hf")
    whole = load_pretrained(tmp_path / "hf")
    monkeypatch.setattr(block_reads, "PIECE_BYTES", 1000)  # a few rows per piece, ~100 pieces in all
    pieces = load_pretrained(tmp_path / "hf")
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(whole)), nnx.to_flat_state(nnx.state(pieces))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    np.testing.assert_array_equal(np.asarray(pieces.lm_head[...]), hf.lm_head.weight.detach().numpy())


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="Linux only (/proc/self/status, madvise)")
def test_host_buffers_are_aligned_prefaulted_and_released():
    """Large buffers: 64-byte (indeed 2 MiB) aligned, made resident by `prefault` before any write (where the
    kernel has MADV_POPULATE_WRITE), and unmapped when the last array viewing them goes."""
    small = host_buffers.host_buffer((3, 5), np.float32)
    assert small.ctypes.data % ALIGN == 0 and small.shape == (3, 5) and small.dtype == np.float32
    size = 48 << 20
    before = _rss_anon()
    big = host_buffers.host_buffer((size // 2,), ml_dtypes.bfloat16)
    assert big.ctypes.data % host_buffers.HUGE_PAGE == 0 and big.shape == (size // 2,) and big.flags.writeable
    assert _rss_anon() - before < size // 8  # address space only, until filled
    half = big[: size // 4]
    host_buffers.prefault(half)
    if host_buffers._POPULATE_WORKS[0]:
        assert _rss_anon() - before > 0.9 * size / 2  # one half resident, nothing written yet
    big[...] = 1
    grown = _rss_anon() - before
    assert grown > 0.9 * size
    del big, half
    assert _rss_anon() - before < grown - 0.9 * size  # unmapped, not left to a later collection


@pytest.mark.parametrize("huge_min, piece", [(None, None), (0, 700)])
def test_unaligned_files_load_bit_identically_and_are_adopted(tmp_path, monkeypatch, huge_min, piece):
    """Files as the safetensors library / transformers / the Hub write them, with data not 64-byte aligned, cannot
    be mapped: every tensor is copied into a fresh aligned buffer (large ones pre-faulted mappings, forced here for
    all tensors, in pieces of a few rows that do not start on a page), which XLA adopts. The values are the
    file's, bit for bit, the logits transformers', and an aligned copy of the same model loads identically."""
    hf = make_hf_model("gemma2", seed=5, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "hub", max_shard_size="20KB")
    starts = rewrite_unaligned(tmp_path / "hub")
    assert len(starts) > 2 and all(start % ALIGN for start in starts)  # really the unaligned case, several files
    save_pretrained(load_pretrained(tmp_path / "hub"), tmp_path / "ours")  # our writer: aligned data
    if huge_min is not None:
        monkeypatch.setattr(host_buffers, "HUGE_BUFFER_MIN_BYTES", huge_min)
        monkeypatch.setattr(block_reads, "PIECE_BYTES", piece)
    made, allocate = set(), host_buffers.host_buffer

    def recording(shape, dtype):
        buffer = allocate(shape, dtype)
        made.add(buffer.ctypes.data)
        return buffer

    monkeypatch.setattr(block_reads, "host_buffer", recording)
    hub = load_pretrained(tmp_path / "hub")
    leaves = nnx.to_flat_state(nnx.state(hub))
    assert {v[...].unsafe_buffer_pointer() for _, v in leaves} == made and len(made) == len(leaves)  # adopted
    if huge_min == 0:  # every buffer a mapping of its own that starts on a huge page
        assert all(address % host_buffers.HUGE_PAGE == 0 for address in made)
    ours = load_pretrained(tmp_path / "ours")
    for (path, a), (_, b) in zip(leaves, nnx.to_flat_state(nnx.state(ours))):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
    np.testing.assert_array_equal(np.asarray(hub.layers[2].mlp.down_proj.weight[...]),
                                  hf.model.layers[2].mlp.down_proj.weight.detach().numpy())
    np.testing.assert_array_equal(np.asarray(hub.lm_head[...]), hf.lm_head.weight.detach().numpy())
    ids = sample_ids(2, 13)
    assert max_abs_diff(np.asarray(hub(jnp.asarray(ids)).logits), hf_logits(hf, ids)) <= 1e-4
