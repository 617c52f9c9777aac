"""benchmarks/host_syncs.py: the reads of tensor values a round makes (on a GPU, host
synchronisations), by call site (issue 30, item 3)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


def _script():
    return load_script(ROOT / "benchmarks" / "host_syncs.py", "host_syncs")


def test_screening_reads_once_per_phase_and_nothing_grows_with_the_clients():
    """FedAvg's round (one phase), batched, 4 and 8 clients: screening reads the phase's NaN /
    Inf sums as one list, and no read grows with the number of clients. The partition's
    offsets (host tensors: no GPU synchronisation) were read twice per client; ``IndexParts``
    now reads them as numbers once, at the run's first client read, so a steady round reads
    none. Measured: the rest is 24 reads at 4 clients and 25 at 8 (a per-cohort metric read
    once more)."""
    script = _script()
    small, large = script.count("fedavg", 4), script.count("fedavg", 8)

    def reads(counts, where: str) -> int:
        return sum(n for site, n in counts.sites.items() if where in site)

    assert reads(small, "screening.py") == reads(large, "screening.py") == 1
    assert reads(small, "partition.py") == reads(large, "partition.py") == 0
    rest_small = sum(small.sites.values()) - reads(small, "partition.py")
    rest_large = sum(large.sites.values()) - reads(large, "partition.py")
    assert rest_large - rest_small <= 2, dict(large.sites)
