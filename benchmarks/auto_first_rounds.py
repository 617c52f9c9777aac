"""What ``auto``'s size rule costs in the first rounds of the demo (issue 30, item 2).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/auto_first_rounds.py [--rounds 12]

Builds ``examples/demo.toml`` (baseline off) on the default ``auto`` backend, steps ``--rounds``
rounds (``Simulation.step``, no evaluation) and prints each round's wall time, the median of
the second half, the families the backend planned and the client works it counted
(:attr:`radbo.simulation.AutoBackend.sizes`: one client's work run under the FLOP and
operation counters once per work). A family first met in a round costs that round one counted
client. To compare two versions of radbo, run this file against each (a second worktree, with
this file copied in), alternated.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import Runner, demo  # noqa: E402
from radbo.simulation import AutoBackend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds to step (at least 2)")
    args = parser.parse_args()
    if args.rounds < 2:
        parser.error(f"--rounds must be at least 2, got {args.rounds}")
    data = demo()
    data["runtime"] = {"backend": "auto"}  # demo() pins the sequential backend
    runner = Runner(data, "cpu")
    backend = runner.exp.simulation.backend
    assert isinstance(backend, AutoBackend)
    times = [runner.step() for _ in range(args.rounds)]
    print(f"demo on the auto backend, {args.rounds} rounds (ms): ", end="")
    print(", ".join(f"{1e3 * t:.0f}" for t in times))
    steady = statistics.median(times[args.rounds // 2 :])
    print(f"median of rounds {args.rounds // 2}-{args.rounds - 1}: {1e3 * steady:.1f} ms")
    print(f"families planned: {len(backend.plan)}; client works counted: {len(backend.sizes)}")


if __name__ == "__main__":
    main()
