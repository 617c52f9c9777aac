"""Suite-wide settings.

radbo's client work is thousands of tiny tensor operations, for which intra-op threads only add
synchronisation (on a busy 2-core machine a tiny forward and backward ran ~3,000x slower on two
threads than on one). The suite therefore runs with one intra-op thread; tests about threads set
their own count and restore it.

The header names the CPU and the kernels PyTorch runs on it (``ATEN_CPU_CAPABILITY``), since
float results differ between them; a capability asked for that the CPU lacks (PyTorch would
fall back silently) stops the session instead of testing other kernels than the log says.
"""

import os
from pathlib import Path

import pytest
import torch


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")[:100_000]
    except OSError:
        return "unknown CPU"
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown CPU"


def pytest_report_header(config: pytest.Config) -> str:
    return f"torch {torch.__version__}, CPU kernels {torch.backends.cpu.get_cpu_capability()} on {_cpu_model()}"


def pytest_sessionstart(session: pytest.Session) -> None:
    asked = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    running = torch.backends.cpu.get_cpu_capability().lower()
    if asked and asked != running:
        raise pytest.UsageError(
            f"ATEN_CPU_CAPABILITY={asked} asked, but PyTorch runs its {running} kernels on this "
            "CPU; run only the capabilities /proc/cpuinfo lists (make test-kernels does)"
        )


@pytest.fixture(autouse=True, scope="session")
def one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def flower_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower messages read the run, node and task ids of the current process, which Flower's
    runtimes set; outside them (the fake grids of the Flower tests) they are set here. Only
    tests that need flwr ask for it, so flwr is imported here, not at the top."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, attr, value)
