"""Can the aggregation's per-client scatter be one scatter per tensor, same bits? (issue 30)

``coverage_weighted_mean`` adds every client's update into a float64 numerator with
:func:`radbo.masks.index.add_at`, client after client: each coordinate receives its holders'
values in client order. One scatter for all clients keeps those bits only if it adds the
duplicates of a coordinate one after another in the order they are listed. This script checks
that, for ``index_put_(accumulate=True)`` and ``index_add_`` (with and without
``torch.use_deterministic_algorithms``), on a 64 x 128 tensor (the demo MLP's first layer)
where ``--clients`` clients each keep a random structured block (rows and columns), and
prints for each way whether the result equals the client-by-client one bitwise, its largest
difference, and the time of both (``--device cuda`` synchronised before each clock stops);
then the same for :func:`radbo.masks.index.add_at_many`, as a loop and as a flat scatter.

    .venv/bin/python benchmarks/scatter_order.py --device cuda --clients 100 1000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from radbo.masks.index import _linear, add_at, add_at_many  # noqa: E402

SHAPE = (64, 128)


def clients(n: int, device: str, generator: torch.Generator) -> list[tuple]:
    """``n`` (row index, column index, float32 value block) triples over three capacities
    (1, 1/2, 1/4); the clients of one capacity share their index tensors, as the importance
    policy's do."""
    selections = [(None, None)]
    for keep in (0.5, 0.25):
        rows = torch.randperm(SHAPE[0], generator=generator)[: int(SHAPE[0] * keep)].sort()[0]
        cols = torch.randperm(SHAPE[1], generator=generator)[: int(SHAPE[1] * keep)].sort()[0]
        selections.append((rows, cols))
    out = []
    for i in range(n):
        rows, cols = selections[i % 3]
        kept = (SHAPE[0] if rows is None else len(rows), SHAPE[1] if cols is None else len(cols))
        value = torch.randn(kept, generator=generator, dtype=torch.float32)
        out.append((rows, cols, value.to(device)))
    return out


def one_by_one(blocks: list[tuple], device: str) -> torch.Tensor:
    num = torch.zeros(SHAPE, dtype=torch.float64, device=device)
    for rows, cols, value in blocks:
        add_at(num, (rows, cols), value)
    return num


def flat(blocks: list[tuple], device: str, way: str) -> torch.Tensor:
    """All clients' coordinates and values in client order, one scatter."""
    index = torch.cat([_linear((rows, cols), torch.Size(SHAPE)) for rows, cols, _ in blocks])
    values = torch.cat([value.reshape(-1) for _, _, value in blocks]).to(torch.float64)
    index = index.to(device)
    num = torch.zeros(SHAPE[0] * SHAPE[1], dtype=torch.float64, device=device)
    if way == "index_put_":
        num.index_put_((index,), values, accumulate=True)
    else:
        num.index_add_(0, index, values)
    return num.reshape(SHAPE)


def timed(fn, device: str):  # noqa: ANN001, ANN201
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("benchmarks/scatter_order.py: no CUDA device is available to torch here")
        return 0
    for n in args.clients:
        blocks = clients(n, args.device, torch.Generator().manual_seed(n))
        one_by_one(blocks, args.device)  # warm-up
        ref, t_ref = timed(lambda: one_by_one(blocks, args.device), args.device)  # noqa: B023
        print(f"{n} clients on {args.device}: client by client {t_ref * 1e3:.1f} ms")
        for way, deterministic in (
            ("index_put_", False),
            ("index_put_", True),
            ("index_add_", False),
            ("index_add_", True),
        ):
            torch.use_deterministic_algorithms(deterministic)
            try:
                flat(blocks, args.device, way)  # warm-up
                got, t = timed(lambda: flat(blocks, args.device, way), args.device)  # noqa: B023
            finally:
                torch.use_deterministic_algorithms(False)
            diff = (got - ref).abs().max().item()
            print(
                f"  {way} (deterministic {deterministic}): bitwise {torch.equal(got, ref)}, "
                f"largest difference {diff:.3g}, {t * 1e3:.1f} ms"
            )
        entries = [(rows, cols) for rows, cols, _ in blocks]
        values = [value for _, _, value in blocks]
        for flat_scatter in (False, True):

            def many(flat_scatter: bool = flat_scatter, e=entries, v=values) -> torch.Tensor:  # noqa: ANN001
                num = torch.zeros(SHAPE, dtype=torch.float64, device=args.device)
                add_at_many(num, e, v, flat=flat_scatter)
                return num

            many()  # warm-up
            got, t = timed(many, args.device)
            print(
                f"  add_at_many(flat={flat_scatter}): bitwise {torch.equal(got, ref)}, "
                f"{t * 1e3:.1f} ms"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
