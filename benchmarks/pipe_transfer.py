"""What moving a model-sized message to a worker process and back costs: the process
backend's wire (``radbo.simulation.processes._dumps`` over a ``multiprocessing`` pipe).

A forked child receives ``{"w": tensor of --floats float32}``, unpickles it and sends it back
pickled the same way; the figure is the median round trip of ``--repeats`` batches of 10, and
beside it what pickling and unpickling alone cost (no pipe). At issue 30's 1M-parameter size a
full-width client's task and result are each about one such message.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipe_transfer.py --floats 1000000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pickle
import statistics
import time
from multiprocessing.connection import Connection

import torch

from radbo.simulation.processes import _dumps


def _echo(conn: Connection) -> None:
    while True:
        message = conn.recv_bytes()
        if message == b"stop":
            return
        conn.send_bytes(_dumps(pickle.loads(message)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floats", type=int, default=1_000_000, help="float32 numbers sent")
    parser.add_argument("--repeats", type=int, default=5, help="batches of 10 round trips")
    args = parser.parse_args()
    message = {"w": torch.randn(args.floats, generator=torch.Generator().manual_seed(0))}
    ours, theirs = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_echo, args=(theirs,))
    child.start()
    trips = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(10):
            ours.send_bytes(_dumps(message))
            back = pickle.loads(ours.recv_bytes())
        trips.append((time.perf_counter() - start) / 10)
    assert torch.equal(back["w"], message["w"])
    start = time.perf_counter()
    for _ in range(10):
        pickle.loads(_dumps(message))
    alone = (time.perf_counter() - start) / 10
    ours.send_bytes(b"stop")
    child.join()
    mb = args.floats * 4 / 1e6
    print(
        f"{mb:.1f} MB: round trip {1e3 * statistics.median(trips):.1f} ms (median of "
        f"{[round(1e3 * t, 1) for t in trips]}), pickling + unpickling alone "
        f"{1e3 * alone:.1f} ms"
    )


if __name__ == "__main__":
    main()
