"""Profile the machine radbo runs on: :func:`probe_host`.

Compute is measured (a short FP32 ``torch.mm`` benchmark), memory and CPU facts come from psutil,
and bandwidth is a documented default unless given, since it cannot be measured without a server.
"""

from __future__ import annotations

import math
import platform
import time

import psutil
import torch

from radbo.devices.profile import DeviceProfile, parse_profile

__all__ = ["DEFAULT_BANDWIDTH_BPS", "measure_matmul_flops", "probe_host"]

DEFAULT_BANDWIDTH_BPS = 100e6
"""Bandwidth :func:`probe_host` assumes when none is given: 100 Mbit/s each way, not measured."""


def measure_matmul_flops(size: int, repeats: int) -> float:
    """Best-of-``repeats`` FP32 throughput of ``torch.mm`` on ``size x size`` matrices, FLOP/s.

    One product counts ``2 * size**3`` FLOPs. One untimed warm-up run comes first. Inputs are
    drawn from a private, fixed-seed :class:`torch.Generator` (no global seeding).
    """
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator, dtype=torch.float32)
    b = torch.randn(size, size, generator=generator, dtype=torch.float32)
    torch.mm(a, b)  # warm-up: thread pool start, allocation
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    best = max(best, 1e-9)  # a timer tick of zero would give an infinite rate
    return 2.0 * size**3 / best


def _cpu_frequency_text() -> str:
    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError, AttributeError):  # unsupported on some platforms
        freq = None
    if freq is None:
        return "CPU frequency unknown (psutil.cpu_freq unavailable)"
    parts = []
    if freq.max:
        parts.append(f"{freq.max:.0f} MHz max")
    if freq.current:
        parts.append(f"{freq.current:.0f} MHz current")
    return ", ".join(parts) if parts else "CPU frequency unknown (psutil reported 0)"


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} = {value!r}: must be an integer >= {minimum}")


def probe_host(
    *,
    matmul_size: int = 512,
    repeats: int = 3,
    memory_fraction: float = 0.5,
    uplink_bps: float = DEFAULT_BANDWIDTH_BPS,
    downlink_bps: float = DEFAULT_BANDWIDTH_BPS,
    availability: float = 1.0,
) -> DeviceProfile:
    """A :class:`DeviceProfile` of this machine (name ``host``, tier ``host``).

    - ``compute_flops``: measured, :func:`measure_matmul_flops` (best of ``repeats`` timings of
      an FP32 ``torch.mm`` of size ``matmul_size``; default 512, 3 repeats) with torch's current
      thread count. A GEMM rate: real training reaches less.
    - ``memory_bytes``: ``memory_fraction`` (default 0.5) of psutil's *available* memory.
    - ``uplink_bps`` / ``downlink_bps``: not measured; default :data:`DEFAULT_BANDWIDTH_BPS`
      (100 Mbit/s) unless given.
    - ``source`` records what was measured: logical CPUs, CPU frequency (when psutil can read it),
      torch threads, the matmul settings and the memory figure.
    """
    _check_int("matmul_size", matmul_size, 1)
    _check_int("repeats", repeats, 1)
    if (
        not isinstance(memory_fraction, int | float)
        or isinstance(memory_fraction, bool)
        or not 0 < memory_fraction <= 1
    ):
        raise ValueError(f"memory_fraction = {memory_fraction!r}: must be a number in (0, 1]")

    flops = measure_matmul_flops(matmul_size, repeats)
    available = int(psutil.virtual_memory().available)
    memory_bytes = max(1, int(memory_fraction * available))
    cpus = psutil.cpu_count(logical=True)
    cpu_text = f"{cpus} logical CPUs" if cpus else "logical CPU count unknown"
    bandwidth_text = (
        "bandwidth: documented default 100 Mbit/s each way (not measured)"
        if uplink_bps == DEFAULT_BANDWIDTH_BPS and downlink_bps == DEFAULT_BANDWIDTH_BPS
        else "bandwidth: given by the caller (not measured)"
    )
    source = (
        f"radbo.devices.probe_host on {platform.system()} {platform.machine()}: "
        f"compute = best of {repeats} FP32 torch.mm {matmul_size}x{matmul_size} "
        f"(2n^3 FLOPs) with {torch.get_num_threads()} torch threads; "
        f"{cpu_text}, {_cpu_frequency_text()} (psutil); "
        f"memory = {memory_fraction} x {available / 1e9:.2f} GB available (psutil); "
        f"{bandwidth_text}"
    )
    return parse_profile(
        {
            "name": "host",
            "tier": "host",
            "compute_flops": flops,
            "memory_bytes": memory_bytes,
            "uplink_bps": uplink_bps,
            "downlink_bps": downlink_bps,
            "availability": availability,
            "source": source,
        }
    )
