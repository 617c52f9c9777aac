"""What the RABO paper scripts share: data, device, the printed command, the up-front check.

Used by ``rabo_fewshot.py`` (Table II), ``rabo_scalability.py`` (Table III),
``rabo_coverage.py`` (Fig. 3), ``rabo_costs.py`` (Fig. 4) and, for the device, the command and
the plot, ``rabo_loss_tuning.py`` (Sec. V-B, Figs. 5-6). Paper: Li, Zhang, Zheng, Shi,
Yuan, Cheng and Yu, "Distributed Bilevel Optimization with Dual Pruning for Resource-limited
Clients" (RABO/RAFBO), Sec. V-A (``papers/rabo_rafbo.txt``).

Data: scikit-learn's digits by default (no files needed; meta-train classes 0-4 split iid over
the clients, meta-test classes 5-9), or Omniglot with ``--omniglot PATH`` (a folder holding
``images_background`` and ``images_evaluation`` in the original layout: the background
alphabets are meta-train, split by whole characters over the clients as in the paper, the
evaluation alphabets meta-test; 20 drawings per character).

:func:`unserved` says, before any run, why the data cannot serve a config (too few meta-train
or meta-test classes for N-way episodes, or a client left with fewer than N classes holding
K + Q examples), as one line that names the fix.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from radbo.config import ConfigError, RunConfig
from radbo.data.partition import FleetTooLargeError
from radbo.experiment.build import examples_per_client, load_data
from radbo.randomness import Stream, generator

#: the paper's five client capacities (Sec. V-A), one client each (cycled over larger fleets)
CAPACITIES = [1.0, 0.5, 0.25, 0.125, 0.0625]
CAPACITY_NAMES = ["1", "1/2", "1/4", "1/8", "1/16"]
#: drawings per Omniglot character (Lake et al., 2015): K + Q of an episode must fit in them
OMNIGLOT_DRAWINGS = 20
#: RABO / RAFBO step sizes and clipping shared by every script
BILEVEL = {"inner_lr": 0.5, "outer_lr": 0.1, "inner_steps": 5, "max_hypergrad_norm": 1.0}


def rabo_sections(refit_steps: int = 0) -> dict[str, Any]:
    """``[algorithm]`` of RABO (Alg. 1; with ``refit_steps`` S > 0 radbo's refit before eq. (7),
    see ``radbo/algorithms/rabo.py``); the estimator is RABO's default, CG."""
    algorithm: dict[str, Any] = {"name": "rabo", **BILEVEL}
    if refit_steps:
        algorithm["refit_steps"] = refit_steps
    return {"algorithm": algorithm}


def rafbo_sections(coordinates: int, coordinate_batch: int = 1) -> dict[str, Any]:
    """``[algorithm]`` and ``[estimator]`` of RAFBO (Alg. 2): the forward finite-difference
    hypergradient of eq. (10) on ``coordinates`` = |P| sampled coordinates of x (the others get
    the direct term only; one gradient of g per coordinate), ``coordinate_batch`` of them per
    evaluation (``--coordinate-batch``; the same arithmetic, see ``[estimator]
    coordinate_batch``)."""
    return {
        "algorithm": {"name": "rafbo", **BILEVEL},
        "estimator": {
            "name": "finite_difference",
            "scheme": "forward",
            "num_coordinates": coordinates,
            **batch_setting(coordinate_batch),
        },
    }


def batch_setting(coordinate_batch: int) -> dict[str, int]:
    """``{"coordinate_batch": n}``, or nothing for the default 1 (so that a default run's
    config reads as it did before the setting existed)."""
    return {"coordinate_batch": coordinate_batch} if coordinate_batch != 1 else {}


def add_coordinate_batch(parser: argparse.ArgumentParser) -> None:
    """``--coordinate-batch``: RAFBO's coordinates per evaluation of grad_y g."""
    parser.add_argument(
        "--coordinate-batch",
        type=int,
        default=1,
        help="RAFBO's coordinates per batched gradient of g ([estimator] coordinate_batch; "
        "the same arithmetic, far fewer kernel launches: set it to |P| with --device cuda)",
    )


def add_common_arguments(
    parser: argparse.ArgumentParser, out: str = "runs/paper", *, omniglot: bool = True
) -> None:
    """``--omniglot`` (the few-shot scripts; not with ``omniglot=False``), ``--device`` and
    ``--out``, the same in every script."""
    if omniglot:
        parser.add_argument(
            "--omniglot",
            default=None,
            metavar="PATH",
            help="Omniglot folder holding images_background and images_evaluation "
            "(default: digits)",
        )
    parser.add_argument(
        "--device",
        default="cpu",
        help='where runs compute ([runtime] device): "cpu" (default), "cuda" or "cuda:N"',
    )
    parser.add_argument("--out", default=out, help="folder for the markdown table and the PNG")


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The exact command that ran ``script`` (printed first and written under every table)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return "OMP_NUM_THREADS=1 .venv/bin/python " + shlex.join(
        [f"benchmarks/paper/{Path(script).name}", *args]
    )


def refuse(reason: str) -> NoReturn:
    """Stop before any run with one line (exit status 1)."""
    raise SystemExit(f"refused: {reason}")


def check_device(device: str) -> None:
    """Refuse a device torch cannot use here (before any run)."""
    try:
        where = torch.device(device)
    except RuntimeError:
        refuse(f'--device {device!r} is not a device; use "cpu", "cuda" or "cuda:N"')
    if where.type not in ("cpu", "cuda"):
        refuse(f'--device {device!r}: radbo runs on "cpu", "cuda" or "cuda:N"')
    if where.type == "cuda" and not torch.cuda.is_available():
        refuse(
            f"--device {device}: no CUDA device is available to torch here "
            "(torch.cuda.is_available() is False); use --device cpu"
        )
    if where.type == "cuda" and where.index is not None:
        count = torch.cuda.device_count()
        if where.index >= count:
            refuse(
                f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to "
                f"cuda:{count - 1}"
            )


def device_label(device: str) -> str:
    """What produced the numbers: the GPU's name, or the CPU model and the cores available."""
    where = torch.device(device)
    if where.type == "cuda":
        index = where.index if where.index is not None else torch.cuda.current_device()
        return f"GPU {torch.cuda.get_device_name(index)} (torch {torch.__version__})"
    model = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                model,
            )
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    kernels = torch.backends.cpu.get_cpu_capability()
    return (
        f"CPU {model}, {cores} cores available, 1 torch thread per run, {kernels} kernels "
        f"(torch {torch.__version__})"
    )


def provenance(device: str) -> str:
    """The sentence under every table: which device produced the numbers, and when."""
    return f"Measured on {device_label(device)}, {datetime.date.today().isoformat()}."


def data_sections(omniglot: str | None, image_size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``[data]`` and ``[partition]``: Omniglot split by characters, or digits split iid."""
    if omniglot:
        return {"name": "omniglot", "root": omniglot, "image_size": image_size}, {"kind": "classes"}
    return {"name": "digits", "image_size": image_size}, {"kind": "iid"}


def data_label(omniglot: str | None, image_size: int, *, where: bool = True) -> str:
    """``Omniglot (PATH) 28x28`` (without the path when not ``where``) or ``digits 16x16``."""
    size = f"{image_size}x{image_size}"
    if not omniglot:
        return f"digits {size}"
    return f"Omniglot ({omniglot}) {size}" if where else f"Omniglot {size}"


def default_queries(omniglot: str | None, shots: int, digits: int = 15) -> int:
    """Q per class: the paper's 20 - K on Omniglot (all of a character's drawings), else
    ``digits``."""
    return OMNIGLOT_DRAWINGS - shots if omniglot else digits


def model_section(name: str, width: int) -> tuple[dict[str, Any], str]:
    """``[model]`` with static BatchNorm (HeteroFL's sBN) and its label: Conv-4 with ``width``
    channels, or ResNet-12 with stages ``width x (1, 2.5, 5, 10)`` (64 -> 64-160-320-640, the
    widths of MetaOptNet and RFS)."""
    if name == "conv4":
        return {"name": "conv4", "width": width, "batchnorm": "static"}, f"Conv-4 width {width}"
    widths = [width, round(2.5 * width), 5 * width, 10 * width]
    label = "ResNet-12 widths " + "-".join(map(str, widths))
    return {"name": "resnet12", "widths": widths, "batchnorm": "static"}, label


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the sections of ``over`` merged into its own (one level deep)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and key in out else value
    return out


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (0 for one seed)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def giga(value: float) -> str:
    """``value`` / 1e9 with as many decimals as a table of small and large runs needs."""
    g = value / 1e9
    return f"{g:,.0f}" if g >= 100 else f"{g:.1f}" if g >= 1 else f"{g:.3f}"


# ---------------------------------------------------------------------- what the data serve
_SPLITS: dict[str, tuple[Any, Any]] = {}


def _meta_splits(config: RunConfig) -> tuple[Any, Any]:
    """(meta-train, meta-test) of ``config``'s data, loaded once per data section and seed."""
    key = json.dumps([config.data.model_dump(mode="json"), config.seed], sort_keys=True)
    if key not in _SPLITS:
        train, test = load_data(config)
        _SPLITS[key] = config.task.split_data(train, test, config.data.disjoint_classes)
    return _SPLITS[key]


def _usable(labels: torch.Tensor, need: int) -> int:
    """Classes with at least ``need`` examples among ``labels``."""
    if labels.numel() == 0:
        return 0
    return int((torch.unique(labels, return_counts=True)[1] >= need).sum())


def _clients_usable(
    config: RunConfig, labels: torch.Tensor, clients: int, need: int | None = None
) -> list[int] | None:
    """Classes with at least ``need`` (default K + Q) examples of every client when the
    partition gives ``clients`` clients (None: the partition cannot make that many)."""
    need = config.task.shots + config.task.queries if need is None else need
    gen = generator(config.seed, Stream.PARTITION)  # the stream radbo.experiment partitions with
    try:
        parts = config.partition.partition(
            labels, clients, gen, min_size=examples_per_client(config)
        )
    except FleetTooLargeError:
        return None
    return [_usable(labels[part], need) for part in parts]


def data_unserved(config: RunConfig) -> str | None:
    """Why the data set cannot serve ``config``'s N-way K-shot episodes whatever the fleet (a
    missing folder, too few meta-train or meta-test classes with K + Q examples), as one line
    naming the fix; None when it can. Loads the data once per data section and seed."""
    task = config.task
    ways, shots, queries = task.ways, task.shots, task.queries
    need = shots + queries
    data = config.data.name
    try:
        train, test = _meta_splits(config)
    except (ConfigError, ValueError) as err:
        return str(err).splitlines()[0]
    if not config.model.flat:  # e.g. ResNet-12 on images smaller than 16x16
        try:
            config.model.image(tuple(train.input_shape), data)
        except ValueError as err:
            return f"--model {config.model.name}: {err} (--image-size)"
    for which, split in (("meta-train", train), ("meta-test", test)):
        usable = _usable(split.labels, need)
        if usable >= ways:
            continue
        most = int(torch.unique(split.labels, return_counts=True)[1].max())
        fixes = []
        if usable >= 2:
            fixes.append(f"--ways {usable} or fewer")
        if most < need:
            fixes.append(f"shots + queries <= {most} (e.g. --queries {max(1, most - shots)})")
        if data == "digits":
            fixes.append("--omniglot PATH (hundreds of characters)")
        return (
            f"{ways}-way {shots}-shot with {queries} queries: {data} has {usable} {which} classes "
            f"with at least shots + queries = {need} examples, a {ways}-way episode needs "
            f"{ways}; use " + ", or ".join(fixes or ["a data set with more classes"])
        )
    return None


def clients_usable(config: RunConfig) -> list[int] | None:
    """Classes with at least K + Q examples that each client of ``config``'s fleet holds, as
    the run will partition them (None: the partition cannot make that many clients)."""
    train, _ = _meta_splits(config)
    return _clients_usable(config, train.labels, config.fleet.num_clients)


def fleet_unserved(config: RunConfig) -> tuple[str, str] | None:
    """Why ``config``'s fleet cannot be served (a client left with fewer than N classes holding
    K + Q examples, or more clients than the partition can make): a short table cell and one
    line naming the fix; None when every client can draw its episodes. Call after
    :func:`data_unserved` found nothing."""
    task = config.task
    ways, shots, queries = task.ways, task.shots, task.queries
    need = shots + queries
    data = config.data.name
    train, _ = _meta_splits(config)
    clients = config.fleet.num_clients
    usable = _clients_usable(config, train.labels, clients)
    if usable is not None and min(usable) >= ways:
        return None
    served = next(
        (
            n
            for n in range(clients - 1, 0, -1)
            if (u := _clients_usable(config, train.labels, n)) and min(u) >= ways
        ),
        0,
    )
    if usable is None:
        cell = "not enough examples"
        problem = f"the {config.partition.kind} partition cannot make {clients} clients"
    else:
        worst = min(range(clients), key=usable.__getitem__)
        held = _clients_usable(config, train.labels, clients, need=1) or usable
        # Omniglot's characters all have 20 drawings: a client lacks classes; digits' clients
        # hold every class, with too few examples of some
        cell = "not enough classes" if held[worst] < ways else "too few examples per class"
        problem = (
            f"client {worst} holds {usable[worst]} classes with at least shots + queries = "
            f"{need} examples ({cell}: a {ways}-way episode needs {ways})"
        )
    fix = f"use at most {served} clients" if served else "use fewer clients"
    line = (
        f"{clients} clients on {data} ({len(torch.unique(train.labels))} meta-train classes, "
        f"{ways}-way {shots}-shot, {queries} queries): {problem}; {fix}, fewer ways, shots or "
        "queries" + (", or --omniglot PATH" if data == "digits" else ", or more data")
    )
    return cell, line


def unserved(config: RunConfig) -> str | None:
    """Why the data cannot serve ``config`` (:func:`data_unserved`, then
    :func:`fleet_unserved`), as one line naming the fix; None when they can."""
    problem = data_unserved(config)
    if problem is None and (fleet := fleet_unserved(config)) is not None:
        problem = fleet[1]
    return problem


def check_served(configs: Sequence[RunConfig]) -> None:
    """Refuse (one line, before any run) the first config the data cannot serve."""
    seen: set[str] = set()
    for config in configs:
        key = json.dumps(
            [
                config.data.model_dump(mode="json"),
                config.partition.model_dump(mode="json"),
                config.task.model_dump(mode="json"),
                config.fleet.num_clients,
                config.seed,
            ],
            sort_keys=True,
        )
        if key in seen:
            continue
        seen.add(key)
        reason = unserved(config)
        if reason is not None:
            refuse(reason)


def plot_curves(
    curves: dict[str, list[list[tuple[int, float]]]],
    path: Path,
    title: str,
    reference: tuple[str, float] | None = None,
    ylabel: str = "meta-test accuracy",
) -> None:
    """Accuracy (``ylabel``, meta-test accuracy by default) against rounds: the mean over seeds
    of every method, with a band of +- one seed standard deviation; ``reference`` (label,
    accuracy) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for i, (name, runs) in enumerate(curves.items()):
        rounds = [r for r, _ in runs[0]]
        stats = [mean_std([run[j][1] for run in runs]) for j in range(len(rounds))]
        mean = [m for m, _ in stats]
        style = "-" if i < 10 else "--"  # the colour cycle has 10 colours
        ax.plot(rounds, mean, marker="o", ms=3, color=f"C{i}", ls=style, label=name)
        if len(runs) > 1:
            ax.fill_between(
                rounds,
                [m - s for m, s in stats],
                [m + s for m, s in stats],
                color=f"C{i}",
                alpha=0.15,
                lw=0,
            )
    if reference is not None:
        ax.axhline(reference[1], color="k", ls="--", lw=1, label=reference[0])
    seeds = len(next(iter(curves.values()), [None]))
    ax.set_xlabel("round")
    ax.set_ylabel(f"{ylabel} (mean of {seeds} seeds; band: +- seed std)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
