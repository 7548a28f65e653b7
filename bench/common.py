"""Shared plumbing for the benchmark scripts: JSON lines, peak RSS, child processes, medians, machine facts.

Every measurement is one JSON object on one line of stdout. A driver script runs each peer in its own child
process (peak RSS is a per-process high-water mark), alternating peers within each repeat, because these machines
are shared and noisy: figures are quoted as medians over repeats and as ratios measured in the same run.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Iterable

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
OUT = os.path.join(BENCH, "out")
CKPT_DIR = os.environ.get("BENCH_CKPT_DIR", os.path.join(OUT, "ckpt"))  # synthetic checkpoints (gitignored)
GIB = 2**30


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status (VmRSS, VmHWM, ...) in bytes; 0 where the field is absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def current_rss_bytes() -> int:
    return status_bytes("VmRSS")


def available_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def wait_for_memory(gib: float, *, timeout_s: float = 1800, poll_s: float = 30) -> float:
    """Block until MemAvailable >= `gib` (other jobs share this machine); returns what was available."""
    deadline = time.time() + timeout_s
    while True:
        free = available_gib()
        if free >= gib or time.time() > deadline:
            if free < gib:
                print(f"[bench] only {free:.1f} GiB available (wanted {gib}); measuring anyway", file=sys.stderr)
            return free
        print(f"[bench] {free:.1f} GiB available, waiting for {gib} GiB", file=sys.stderr, flush=True)
        time.sleep(poll_s)


def emit(record: dict, out_path: str | None = None) -> dict:
    """Print one JSON line (and append it to `out_path`), tagged with the run id of bench/run_all.sh if set."""
    if os.environ.get("BENCH_RUN") and "run" not in record:
        record = {**record, "run": os.environ["BENCH_RUN"]}
    line = json.dumps(record, sort_keys=False, default=_plain)
    print(line, flush=True)
    if out_path:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "a") as f:
            f.write(line + "\n")
    return record


def _plain(value):
    try:
        import numpy as np

        if isinstance(value, np.generic):
            return value.item()
    except ImportError:
        pass
    return str(value)


def median_seconds(fn, *args, repeats: int = 5) -> float:
    """Median wall time of `fn(*args)` (a jax computation, waited for) over `repeats` calls after one untimed
    call that compiles and warms up."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def round_floats(record: dict, digits: int = 4) -> dict:
    """Round float fields for readability; losses keep full precision (peers are compared on them)."""
    return {k: (round(v, digits) if isinstance(v, float) and "loss" not in k else v) for k, v in record.items()}


def evict_from_page_cache(paths: Iterable[str]) -> None:
    """Drop these files' clean pages from the page cache (posix_fadvise DONTNEED), for cold-read measurements.

    Only the named files are affected, not the other users of this shared machine."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(f) for f in safetensors_files(folder))


def safetensors_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))


def read_files_sequentially(paths: Iterable[str], block: int = 64 << 20) -> int:
    """Read files front to back into one reused buffer; returns bytes read (the I/O floor of any loader)."""
    buffer = bytearray(block)
    view = memoryview(buffer)
    total = 0
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    return total


def run_child(cmd: list[str], *, env: dict | None = None, timeout: float | None = None,
              cwd: str | None = ROOT) -> dict:
    """Run one measurement in a fresh process and return the last JSON object it printed on stdout.

    A failure returns {"error": ...} with the tail of stderr, so a broken peer does not stop the others."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONPATH", ROOT)
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s: {' '.join(cmd)}"}
    wall = time.perf_counter() - started
    record = None
    for line in reversed(proc.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                record = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if proc.returncode or record is None:
        tail = (proc.stderr or "")[-3000:]
        return {"error": f"exit {proc.returncode}: {' '.join(cmd[:4])} ...", "stderr_tail": tail}
    record.setdefault("process_wall_s", round(wall, 3))
    return record


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("jax", "flax", "optax", "torch", "transformers", "safetensors", "tunix"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception:
            pass
    return out


def machine() -> dict:
    """A description of this machine for BENCHMARKS.md."""
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            total = int(f.readline().split()[1]) / 2**20
    except OSError:
        total = 0.0
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        flags = "AVX-512" if "avx512f" in text else ("AVX2" if "avx2" in text else "")
        if "avx512_bf16" in text:
            flags += " (+bf16)"
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "simd": flags, "mem_gib": round(total, 1),
            "os": f"{platform.system()} {platform.release()}", "date": time.strftime("%Y-%m-%d")}


def python_of_this_venv() -> str:
    return sys.executable


# ---------------------------------------------------------------- report helpers (bench/report*.py)
def latest(records: list[dict], **match) -> dict | None:
    found = [r for r in records if all(r.get(k) == v for k, v in match.items())]
    return found[-1] if found else None


def fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


if __name__ == "__main__":  # the environment line that bench/run_all.sh writes first
    emit({"bench": "environment", "machine": machine(), "versions": versions()},
         sys.argv[1] if len(sys.argv) > 1 else None)


def device_memory(stats: dict | None) -> dict:
    """The device's memory as the chip counts it: on a TPU, XLA reserves a program's temporaries apart from the
    allocator's buffers (`bytes_reserved`), so what a step holds is `bytes_in_use + bytes_reserved` (their peaks
    likewise); `peak_bytes_in_use` alone misses most of a step. GPUs report no reservation (0)."""
    if not stats or "peak_bytes_in_use" not in stats:
        return {}
    reserved, peak_reserved = stats.get("bytes_reserved", 0), stats.get("peak_bytes_reserved", 0)
    return {"peak_device_bytes": stats["peak_bytes_in_use"] + peak_reserved,
            "device_bytes": stats["bytes_in_use"] + reserved, "peak_bytes_in_use": stats["peak_bytes_in_use"],
            "bytes_reserved": reserved, "bytes_limit": stats.get("bytes_limit")}
