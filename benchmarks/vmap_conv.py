"""Why stacked (vmapped) convolutions lose to one client at a time on CPU: layer by layer.

``torch.vmap`` over a convolution whose weights differ per client (radbo's batched backend:
every client trains its own copy) runs one grouped convolution, ``groups = clients``, on the
clients' inputs concatenated along channels. This times, per layer of pfl-research's CIFAR-10
``simple_cnn`` (``benchmarks/vs_pfl.py``) and of CNN7 at 16x16 and 32x32, forward + backward (the
gradient with respect to the weights and the input, as a local step takes it) for ``--clients``
clients with a batch of ``--batch`` each:

* ``loop``: one client after another (what the sequential backend runs);
* ``vmap``: ``torch.func.vmap(torch.func.grad(...))`` over the clients (the batched backend);
* ``grouped``: the grouped convolution the vmap becomes, written out (``groups = clients``,
  contiguous NCHW), to tell vmap's own overhead from the kernel's;
* ``grouped_cl``: the same in channels-last memory layout;
* ``stacked_plain``: each client's own plain convolution (the loop's kernels), the outputs
  stacked into one ``[clients, batch, ...]`` tensor and the rest of the loss taken on that, as
  the batched backend takes every other operation: what stacking costs besides the grouped
  kernel (the stacked activations' trips through memory: ``clients`` times one client's
  activations, which stop fitting in the cache where one client's do).

``--forward`` times the forward pass alone (RABO's inner steps train only the output layer, so
they run a CNN body forward only), with ``own_concatenated`` in place of ``stacked_plain``: each
client's own convolution, the outputs concatenated beside the channels, where the next stacked
convolution reads them in place (a rule that ran pfl-research's first convolution so, tried at
commit 47d9cec, gained nothing in whole rounds: BENCHMARKS.md, "The first convolution client
by client: tried, not kept").

The sides alternate, ``--repeats`` times; medians in ms. Freed memory is kept for reuse
(:func:`radbo.allocator.retain_freed_memory`), as ``radbo run`` does by default, so that no
side pays the kernel's page faults for its large blocks; ``--system-allocator`` leaves glibc
as it is (the stacked sides' tens-of-MB blocks are then unmapped when freed and faulted in
again at every call). Run with one thread:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vmap_conv.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vmap_conv.py --forward --batch 32
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import grad, vmap

from radbo.allocator import retain_freed_memory

#: name -> (in channels, out channels, kernel, image size)
LAYERS: dict[str, tuple[int, int, int, int]] = {
    "simple_cnn conv1 (3->32, 3x3, 32x32)": (3, 32, 3, 32),
    "simple_cnn conv2 (32->64, 3x3, 30x30)": (32, 64, 3, 30),
    "cnn7 conv1 (1->6, 5x5, 16x16)": (1, 6, 5, 16),
    "cnn7 conv2 (6->16, 5x5, 6x6)": (6, 16, 5, 6),
    "cnn7 conv1 (1->6, 5x5, 32x32)": (1, 6, 5, 32),
    "cnn7 conv2 (6->16, 5x5, 14x14)": (6, 16, 5, 14),
}


def loss(w: Tensor, x: Tensor) -> Tensor:
    return F.conv2d(x, w).square().mean()


#: a side's column in the table
LABELS = {
    "loop": "loop (ms)",
    "vmap": "vmap (ms)",
    "grouped": "grouped (ms)",
    "grouped_cl": "grouped, channels-last (ms)",
    "stacked_plain": "stacked, plain kernels (ms)",
    "own_concatenated": "own, concatenated (ms)",
}


def forward_sides(
    clients: int, batch: int, c: int, o: int, k: int, size: int
) -> dict[str, Callable]:
    """The forward pass alone of each side (``--forward``)."""
    gen = torch.Generator().manual_seed(0)
    ws = torch.randn(clients, o, c, k, k, generator=gen) * 0.1
    xs = torch.randn(clients, batch, c, size, size, generator=gen)
    wg = ws.reshape(clients * o, c, k, k)
    xg = xs.transpose(0, 1).reshape(batch, clients * c, size, size)
    xcl, wcl = (t.contiguous(memory_format=torch.channels_last) for t in (xg, wg))
    return {
        "loop": lambda: [F.conv2d(xs[i], ws[i]) for i in range(clients)],
        "vmap": lambda: vmap(F.conv2d)(xs, ws),
        "grouped": lambda: F.conv2d(xg, wg, groups=clients),
        "grouped_cl": lambda: F.conv2d(xcl, wcl, groups=clients),
        "own_concatenated": lambda: torch.cat([F.conv2d(xs[i], ws[i]) for i in range(clients)], 1),
    }


def sides(clients: int, batch: int, c: int, o: int, k: int, size: int) -> dict[str, Callable]:
    gen = torch.Generator().manual_seed(0)
    ws = torch.randn(clients, o, c, k, k, generator=gen) * 0.1
    xs = torch.randn(clients, batch, c, size, size, generator=gen)
    both = grad(loss, argnums=(0, 1))

    def loop() -> object:
        return [both(ws[i], xs[i]) for i in range(clients)]

    def stacked() -> object:
        return vmap(both)(ws, xs)

    wg = ws.reshape(clients * o, c, k, k).requires_grad_(True)
    xg = xs.transpose(0, 1).reshape(batch, clients * c, size, size).requires_grad_(True)
    xcl = xg.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
    wcl = wg.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)

    def grouped(x: Tensor = xg, w: Tensor = wg) -> object:
        out = F.conv2d(x, w, groups=clients).square().mean()
        return torch.autograd.grad(out, (w, x))

    wp = ws.clone().requires_grad_(True)
    xp = xs.clone().requires_grad_(True)

    def stacked_plain() -> object:
        out = torch.stack([F.conv2d(xp[i], wp[i]) for i in range(clients)])
        per_client = out.square().mean(dim=(1, 2, 3, 4))  # each client's loss, as vmap has it
        return torch.autograd.grad(per_client.sum(), (wp, xp))

    return {
        "loop": loop,
        "vmap": stacked,
        "grouped": grouped,
        "grouped_cl": lambda: grouped(xcl, wcl),
        "stacked_plain": stacked_plain,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--system-allocator", action="store_true", help="leave glibc as it is")
    parser.add_argument("--forward", action="store_true", help="the forward pass alone")
    args = parser.parse_args()
    if not args.system_allocator:
        retain_freed_memory()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), median of "
        f"{args.repeats}, batch {args.batch}, {'forward' if args.forward else 'forward + backward'}"
    )
    print()
    make = forward_sides if args.forward else sides
    keys = list(make(1, 1, *LAYERS[args.layers[0]]))
    print("| layer | clients | " + " | ".join(LABELS[k] for k in keys) + " |")
    print("|---|---:|" + "---:|" * len(keys))
    for name in args.layers:
        for n in args.clients:
            runs = make(n, args.batch, *LAYERS[name])
            times: dict[str, list[float]] = {k: [] for k in runs}
            for f in runs.values():
                f()  # warm-up
            for _ in range(args.repeats):
                for key, f in runs.items():
                    start = time.perf_counter()
                    f()
                    times[key].append(time.perf_counter() - start)
            ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
            cells = " | ".join(f"{ms[k]:.1f}" for k in keys)
            print(f"| {name} | {n} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
