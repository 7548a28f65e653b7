"""What `--aot TARGET` compiles for: a TPU slice's compile-only devices (through libtpu, on a machine with no TPU),
or `cpu:N` host devices; and each chip's published figures.

libtpu is kept out of the ordinary environment (`make` installs it in a side folder, `.venv/libtpu`, that is not on
the import path), so an ordinary run never tries to start a TPU; it is loaded only here, right before JAX asks it
for a topology. Found, in order: `TPU_LIBRARY_PATH`, an importable `libtpu` package, `<sys.prefix>/libtpu/libtpu/
libtpu.so` (the side folder). Its version must match jax's own `tpu` extra pin.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.metadata
import importlib.util
import math
import os
import re
import sys

import jax
import numpy as np

from nnx_surgery.refusals import RecipeError
from nnx_surgery.distill.mesh import format_mesh_spec, sizes_using

GIB = 2 ** 30
DOCS = "https://cloud.google.com/tpu/docs/"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One chip's published figures (Google Cloud TPU documentation, the page in `source`): memory per chip, peak
    bf16 FLOP/s per chip, memory bandwidth per chip (bytes/s), chips per host."""

    name: str
    kind: str  # the device_kind JAX reports
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bandwidth: float
    chips_per_host: int
    source: str


# The one table of target figures. Each page lists the chip's HBM (v4 in GiB, the others "GB" of 2**30 bytes, as
# the HBM stacks are sized), peak bf16 compute and HBM bandwidth; XLA reserves a little of the HBM for itself.
CHIPS = {
    "v4": Chip("v4", "TPU v4", 32 * GIB, 275e12, 1200e9, 4, DOCS + "v4"),
    "v5e": Chip("v5e", "TPU v5 lite", 16 * GIB, 197e12, 819e9, 8, DOCS + "v5e"),
    "v5p": Chip("v5p", "TPU v5", 95 * GIB, 459e12, 2765e9, 4, DOCS + "v5p"),
    "v6e": Chip("v6e", "TPU v6 lite", 32 * GIB, 918e12, 1640e9, 8, DOCS + "v6e"),
}
# Topology names libtpu accepts (a chip, then the slice's chips along each axis); others of the same form work too.
KNOWN_TOPOLOGIES = ("v5e:1x1", "v6e:1x1", "v4:2x2x1", "v4:2x2x2", "v4:2x2x4", "v4:2x4x4", "v4:4x4x4", "v5e:2x2", "v5e:2x4", "v5e:4x4",
                    "v5e:4x8", "v5e:8x8", "v5e:8x16", "v5e:16x16", "v5p:2x2x1", "v5p:2x2x2", "v5p:2x4x4",
                    "v5p:4x4x4", "v6e:2x2", "v6e:2x4", "v6e:4x4", "v6e:4x8", "v6e:8x8", "v6e:16x16")
ACCELERATOR_TYPES = {"v4": "v4-8", "v5e": "v5litepod-8", "v5p": "v5p-8", "v6e": "v6e-8"}
FALLBACK_PIN = "0.0.42.*"
SIDE_FOLDER = os.path.join("libtpu", "libtpu", "libtpu.so")


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a run compiles for and their figures per device (a v4 chip shows as two devices: each gets
    half the chip's memory and compute). `chip` None: host devices (no published peak; memory is the host's)."""

    name: str
    devices: tuple
    chip: Chip | None
    cores_per_chip: int
    hosts: int
    memory_per_device: int

    @property
    def peak_flops_per_device(self) -> float | None:
        return self.chip.peak_bf16_flops / self.cores_per_chip if self.chip else None

    @property
    def bandwidth_per_device(self) -> float | None:
        return self.chip.hbm_bandwidth / self.cores_per_chip if self.chip else None

    @property
    def platform(self) -> str:
        return "cpu" if self.chip is None else "tpu"

    def describe(self) -> str:
        if self.chip is None:
            shared = self.memory_per_device * len(self.devices) / GIB
            return f"{self.name}: {len(self.devices)} host devices sharing {shared:.1f} GiB of memory"
        return (f"{self.name}: {len(self.devices)} {self.chip.kind} devices on {self.hosts} host(s), "
                f"{self.memory_per_device / GIB:.2f} GiB each")


def prepare_host_devices(target: str | None) -> None:
    """Ask JAX for N host devices when the target is `cpu:N` (--aot cpu:N), before its CPU client starts (a process
    that already started it keeps its devices; `resolve_target` then says so)."""
    match = re.fullmatch(r"cpu:(\d+)", target or "")
    count = int(match.group(1)) if match else 0
    if count >= 1 and not _backends_started():
        jax.config.update("jax_num_cpu_devices", count)


def _backends_started() -> bool:
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def resolve_target(text: str) -> Target:
    """`cpu:N` or a TPU topology name (KNOWN_TOPOLOGIES), as a Target; RecipeError otherwise."""
    match = re.fullmatch(r"cpu:(\d+)", text)
    if match:
        return host_target(int(match.group(1)))
    chip = CHIPS.get(text.partition(":")[0])
    if chip is None or not re.fullmatch(r"[a-z0-9]+:\d+(x\d+)+", text):
        raise RecipeError(f"--aot {text}: not a target; give cpu:N or a TPU topology such as "
                          f"{', '.join(KNOWN_TOPOLOGIES)} (chips: {', '.join(CHIPS)}).")
    devices = topology_devices(text, chip)
    chips = len({tuple(getattr(d, "coords", (i,))) for i, d in enumerate(devices)})
    cores = max(1, len(devices) // max(1, chips))
    hosts = len({d.process_index for d in devices})
    return Target(text, tuple(devices), chip, cores, hosts, usable_memory(devices, chip.hbm_bytes // cores))


def usable_memory(devices: list, nominal: int) -> int:
    """The bytes per device XLA lets a program use on these TPU devices: the chip's HBM less what the runtime keeps
    (a v5e: 15.75 of 16 GiB), read from XLA's own refusal of a program that asks for twice the nominal figure (one
    compile of well under a second); `nominal` if the refusal does not say."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    one = NamedSharding(Mesh(np.asarray(devices[:1]), ("device",)), PartitionSpec())
    try:
        jax.jit(lambda: jnp.zeros((2 * nominal,), jnp.uint8), out_shardings=one).lower().compile()
    except Exception as error:  # noqa: BLE001  (XLA's RESOURCE_EXHAUSTED is a plain runtime error)
        refusal = out_of_memory(error)
        if refusal and refusal.get("available"):
            return int(refusal["available"])
    return nominal


def host_target(count: int) -> Target:
    """`count` of this process's CPU devices; their memory is the machine's, shared."""
    if count < 1:
        raise RecipeError(f"--aot cpu:{count}: give at least 1 host device.")
    devices = jax.devices("cpu")
    if len(devices) < count:
        raise RecipeError(f"--aot cpu:{count}: this process has {len(devices)} host device(s) and JAX has started; "
                          f"run the command in a new process (it asks for {count} before JAX starts), or set "
                          f"XLA_FLAGS=--xla_force_host_platform_device_count={count}.")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Target(f"cpu:{count}", tuple(devices[:count]), None, 1, 1, memory // count)


def libtpu_pin() -> str:
    """The libtpu version jax's `tpu` extra asks for (e.g. 0.0.42.*)."""
    for requirement in importlib.metadata.requires("jax") or ():
        match = re.match(r"libtpu\s*==\s*([\w.*]+)", requirement)
        if match and "tpu" in requirement:
            return match.group(1)
    return FALLBACK_PIN


def install_hint(pin: str) -> str:
    return f"pip install --target {os.path.join(sys.prefix, 'libtpu')} 'libtpu=={pin}' (or make test)"


def find_libtpu() -> str:
    """The libtpu.so to load (module docstring), its version checked against jax's pin; RecipeError otherwise."""
    pin = libtpu_pin()
    path = os.environ.get("TPU_LIBRARY_PATH")
    if not path:
        spec = importlib.util.find_spec("libtpu")
        located = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else None
        path = os.path.join(located, "libtpu.so") if located else os.path.join(sys.prefix, SIDE_FOLDER)
    if not os.path.isfile(path):
        raise RecipeError(f"--aot for a TPU needs libtpu=={pin} (jax {jax.__version__}'s pin), not found at "
                          f"{path}: {install_hint(pin)}.")
    version = libtpu_version(path)
    if version is None or not re.fullmatch(pin.replace(".", r"\.").replace("*", r".*"), version):
        raise RecipeError(f"--aot: libtpu {version or '(version unknown)'} at {path} does not match jax "
                          f"{jax.__version__}'s pin libtpu=={pin}: {install_hint(pin)}.")
    return path


def libtpu_version(library: str) -> str | None:
    """The version in the dist-info folder beside the `libtpu` package holding `library`."""
    for folder in glob.glob(os.path.join(os.path.dirname(os.path.dirname(library)), "libtpu-*.dist-info")):
        return os.path.basename(folder)[len("libtpu-"):-len(".dist-info")]
    return None


@contextlib.contextmanager
def _quiet_libtpu(library: str, chip: Chip):
    """The variables libtpu reads when it starts, set for the topology call only: the library, a host it need
    not look for (no metadata server, one worker, a slice type), so it starts without warnings, and leave to load
    beside other processes (its lock file guards a TPU this machine does not have; compiling needs none)."""
    values = {"TPU_LIBRARY_PATH": library, "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
              "TPU_ACCELERATOR_TYPE": ACCELERATOR_TYPES[chip.name], "TPU_WORKER_ID": "0",
              "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    before = {key: os.environ.get(key) for key in values}
    os.environ.update({key: os.environ.get(key) or value for key, value in values.items()})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def topology_devices(name: str, chip: Chip) -> list:
    """The compile-only devices of TPU topology `name` (libtpu loaded on first use; this process's own devices
    are started first, so they stay what they were)."""
    library = find_libtpu()
    jax.devices()
    from jax.experimental import topologies
    with _quiet_libtpu(library, chip):
        try:
            return list(topologies.get_topology_desc(topology_name=name, platform="tpu", **host_bounds(name))
                        .devices)
        except Exception as error:  # libtpu's INVALID_ARGUMENT for a shape it does not know
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise RecipeError(f"--aot {name}: libtpu refuses the topology ({first}); known ones: "
                              f"{', '.join(KNOWN_TOPOLOGIES)}.") from None


def host_bounds(name: str) -> dict:
    """libtpu's `chips_per_host_bounds` for a slice smaller than one host (v5e:1x1, v5e:2x1, v4:1x1x1): the slice
    itself. libtpu's default is a whole host's chips (2x2x1), which such a slice does not divide; larger slices
    keep the default."""
    dims = [int(d) for d in name.partition(":")[2].split("x")]
    if math.prod(dims) >= 4:
        return {}
    return {"chips_per_host_bounds": tuple(dims + [1] * (3 - len(dims)))}


def target_mesh(target: Target, sizes: dict[str, int]):
    """A mesh with Auto axes of `sizes` over the target's devices (sizes must use them all)."""
    from jax.sharding import AxisType, Mesh
    needed = math.prod(sizes.values())
    if needed != len(target.devices):
        raise RecipeError(f"--mesh {format_mesh_spec(sizes)} uses {needed} device(s) but --aot {target.name} has "
                          f"{len(target.devices)}; e.g. --mesh "
                          f"{' or --mesh '.join(sizes_using(list(sizes), len(target.devices), sizes))}.")
    try:
        return jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes),
                             devices=list(target.devices))
    except (AssertionError, ValueError, NotImplementedError):  # e.g. a v4 slice's two devices per chip
        grid = np.asarray(target.devices, dtype=object).reshape(tuple(sizes.values()))
        return Mesh(grid, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))



UNITS = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


def out_of_memory(error: BaseException) -> dict | None:
    """XLA's out-of-memory refusal as {"needed": bytes, "available": bytes, "message"}, or None for other errors."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    found = re.search(r"\(([\d.]+)([KMGT])\) exceeds? available \w+ \(([\d.]+)([KMGT])\)", text) or \
        re.search(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT])", text)
    line = next((part.strip() for part in text.splitlines() if "exceed" in part or "Ran out" in part),
                text.splitlines()[0] if text else "")
    row: dict[str, str | float] = {"message": " ".join(line.split())[:300]}
    if found:
        row["needed"] = float(found.group(1)) * UNITS[found.group(2)]
        row["available"] = float(found.group(3)) * UNITS[found.group(4)]
    return row


__all__ = ["out_of_memory", "Chip", "CHIPS", "KNOWN_TOPOLOGIES", "Target", "resolve_target", "host_target", "prepare_host_devices",
           "cpu_count_asked", "find_libtpu", "host_bounds", "libtpu_pin", "topology_devices", "usable_memory", "target_mesh", "GIB"]
