"""What moving a model-sized message to a worker process and back costs, on the process
backend's two wires: the tensors' bytes in the pipe (``radbo.simulation.processes._dumps``),
and in shared memory with only a header in the pipe (``_pack`` with an ``_Arena`` each way,
what the backend uses where it can map shared memory).

A forked child receives ``{"w": tensor of --floats float32}``, unpacks it and sends it back
packed the same way; the figure is the median round trip of ``--repeats`` batches of 10 per
wire, the wires alternated batch by batch (after one warm-up batch each, which also commits the
shared pages), and beside it what packing and unpacking alone cost (no pipe, no child). At
issue 30's 1M-parameter size a full-width client's task and result are each about one such
message.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/pipe_transfer.py --floats 1000000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import torch

from radbo.simulation.processes import _SLOT_BYTES, _Arena, _pack, _unpack

Arenas = tuple[_Arena, _Arena] | None  # (parent -> child, child -> parent), None: the pipe only


def _echo(conn: Connection, wires: dict[str, Arenas]) -> None:
    torch.set_num_threads(1)
    while True:
        message = conn.recv_bytes()
        if message == b"stop":
            return
        wire, body = message.split(b"|", 1)
        arenas = wires[wire.decode()]
        inbound, outbound = arenas if arenas is not None else (None, None)
        conn.send_bytes(_pack(_unpack(body, inbound), outbound))


def _trip(conn: Connection, wire: str, arenas: Arenas, message: dict) -> dict:
    outbound, inbound = arenas if arenas is not None else (None, None)
    conn.send_bytes(wire.encode() + b"|" + _pack(message, outbound))
    return _unpack(conn.recv_bytes(), inbound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--floats", type=int, default=1_000_000, help="float32 numbers sent")
    parser.add_argument("--repeats", type=int, default=5, help="batches of 10 round trips")
    args = parser.parse_args()
    torch.set_num_threads(1)
    message = {"w": torch.randn(args.floats, generator=torch.Generator().manual_seed(0))}
    wires: dict[str, Arenas] = {"pipe": None, "shared": _Arena.pair(_SLOT_BYTES)}
    if wires["shared"] is None:
        raise SystemExit("no shared memory can be mapped here: only the pipe wire exists")
    ours, theirs = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_echo, args=(theirs, wires))
    child.start()
    trips: dict[str, list[float]] = {wire: [] for wire in wires}
    for batch in range(args.repeats + 1):  # batch 0: warm-up
        for wire, arenas in wires.items() if batch % 2 else reversed(wires.items()):
            start = time.perf_counter()
            for _ in range(10):
                back = _trip(ours, wire, arenas, message)
            if batch:
                trips[wire].append((time.perf_counter() - start) / 10)
            assert torch.equal(back["w"], message["w"])
    ours.send_bytes(b"stop")
    child.join()
    mb = args.floats * 4 / 1e6
    print(f"{mb:.1f} MB float32, round trip to a forked process and back, median of batches of 10:")
    for wire, arenas in wires.items():
        outbound = None if arenas is None else arenas[0]
        inbound = None if arenas is None else arenas[1]
        start = time.perf_counter()
        for _ in range(10):
            _unpack(_pack(message, outbound), outbound)
            _unpack(_pack(message, inbound), inbound)
        alone = (time.perf_counter() - start) / 10
        samples = [round(1e3 * t, 1) for t in trips[wire]]
        print(
            f"  {wire:6}: {1e3 * statistics.median(trips[wire]):5.1f} ms ({samples}); "
            f"packing + unpacking alone (both ways) {1e3 * alone:.1f} ms"
        )
    ratio = statistics.median(trips["shared"]) / statistics.median(trips["pipe"])
    print(f"  shared / pipe: {ratio:.2f}x")


if __name__ == "__main__":
    main()
