"""Where a batched round's aten operations come from: one steady round of the demo fleet
counted under a ``TorchDispatchMode``, grouped by the radbo function that dispatched each
operation (the innermost frame in ``radbo/``) and by operation (issue 30 item 3).

On a GPU nearly every aten operation launches a kernel, and for the small models radbo
simulates the launches, not the arithmetic, bound a round (``benchmarks/padding.py`` prints
the totals). This is the map of what to stack, cache or capture next: operations that grow
with the clients (per-client draws, scatters, extraction) against those that grow with the
stacked cohorts. Views (``view``, ``slice``, ``detach``, ...: the operations whose schema
says they alias their input) launch no kernel on any device and are counted apart. The counts
do not depend on the device, so they are taken on the CPU; note that on a GPU run some
operations stay on the CPU by design (index sets, generators and the minibatch draws from
them), so they cost host time there but launch nothing.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/op_sites.py --clients 100 1000 --algorithm rabo
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from types import FrameType

from radbo._torch_private import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.padding import make_side  # noqa: E402

PACKAGE = str(ROOT / "radbo")
HERE = str(ROOT / "radbo" / "_torch_private.py")


def _site(frame: FrameType | None) -> str:
    """``module.py:function`` of the innermost frame in radbo's package, or ``(outside radbo)``."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE) and name != HERE:
            return f"{Path(name).relative_to(ROOT)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside radbo)"


class SiteCounter(TorchDispatchMode):
    """Counts every aten operation dispatched under it, by radbo call site and by operation;
    views (no kernel) in ``*_views``, the others in ``sites`` and ``ops``."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.site_views: Counter[str] = Counter()
        self.op_views: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        site, op = _site(sys._getframe(1)), str(func.overloadpacket.__name__)
        if func.is_view:
            self.site_views[site] += 1
            self.op_views[op] += 1
        else:
            self.sites[site] += 1
            self.ops[op] += 1
        return func(*args, **(kwargs or {}))


def count_round(clients: int, algorithm: str) -> SiteCounter:
    """The aten operations of one steady round (the third) of the padded batched demo fleet."""
    side = make_side(clients, algorithm, "batched, padded")
    side.step()  # round 0: FLOP measurements
    side.step()
    with SiteCounter() as counter:
        side.step()
    return counter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100])
    parser.add_argument("--algorithm", default="rabo")
    parser.add_argument("--top", type=int, default=15, help="rows per table")
    args = parser.parse_args(argv)
    for clients in args.clients:
        counter = count_round(clients, args.algorithm)
        total, views = sum(counter.sites.values()), sum(counter.site_views.values())
        print(
            f"\n{args.algorithm}, {clients} demo clients, batched (padded): "
            f"{total + views:,} aten ops, {total:,} of them not views"
        )
        tables = (
            ("radbo function", counter.sites, counter.site_views),
            ("operation", counter.ops, counter.op_views),
        )
        for title, counts, aliases in tables:
            print(f"\n| {title} | ops, not views | share | views |\n|---|---:|---:|---:|")
            for key, n in counts.most_common(args.top):
                print(f"| `{key}` | {n:,} | {100 * n / total:.1f} % | {aliases[key]:,} |")
            rest = total - sum(n for _, n in counts.most_common(args.top))
            print(f"| (the rest) | {rest:,} | {100 * rest / total:.1f} % | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
