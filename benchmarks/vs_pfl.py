"""radbo's ``fedavg`` against pfl-research (Apple's FL simulator) on pfl's CIFAR-10 FedAvg setup.

pfl-research's CIFAR-10 benchmark (``benchmarks/image_classification`` of
github.com/apple/pfl-research, ``configs/baseline.yaml``): 1,000 iid users of 50 images, 50
users per round, one local epoch of SGD with batch 10 and learning rate 0.1, central SGD with
learning rate 1.0 (plain averaging of the users' models), its ``simple_cnn``, no differential
privacy. Speed does not depend on the pixels, so the data are synthetic and CIFAR-shaped
(32x32x3, 10 classes), written by this script from a seed.

What the script does:

1. creates a virtual environment for pfl (``--venv``, default ``.venv-pfl`` at the repository
   root) when it has no Python yet, and installs ``pfl[pytorch]==0.6.0`` and ``torch==2.13.0``
   into it from the package index by name;
2. writes the synthetic data to ``--data`` (default ``runs/bench/vs_pfl_data``), once per
   size and seed: ``images.npy`` (uint8, ``N x 32 x 32 x 3``) and ``labels.npy`` for pfl, and
   the same images as CIFAR-10 binary batches (``data_batch_1.bin`` ... ``data_batch_5.bin``
   plus a small ``test_batch.bin``), which radbo's ``[data] name = "cifar10"`` reads;
3. runs the two sides alternated, ``--repeats`` times: the pfl side
   (``benchmarks/pfl_side.py`` in the pfl environment, a fresh process each time) and the
   radbo side for every backend in ``--backends`` (a fresh process each: ``sequential``,
   ``batched``, ``auto``, ``processes`` with ``--workers`` workers; a side named
   ``backend:channels_last``, e.g. ``sequential:channels_last``, runs that backend with
   ``[runtime] memory_format = "channels_last"``; ``batched:cuda_graphs`` on a GPU, with
   ``[runtime] cuda_graphs = true``, FedAvg's local steps replayed from CUDA graphs); the
   order flips every
   repetition (pfl first, then radbo first). Every side builds its simulation, runs ``--rounds``
   rounds and reports the median seconds of rounds 1.. (round 0 is the warm-up: radbo
   measures its FLOPs there, pfl evaluates the cohort there); no evaluation is timed;
4. prints a table: each radbo backend, pfl, and the plain-PyTorch floor (the same local
   step as a bare ``nn.Module`` + ``torch.optim.SGD`` loop, timed before every side's run:
   :func:`floor_seconds`; also with channels-last images when a side is), each
   with its seconds per round (median over the
   repetitions and the range), the ratio radbo / pfl, the ratio to the floor and the device.

Both sides run with one intra-op thread (``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``,
``torch.set_num_threads(1)``); ``processes`` uses ``--workers`` worker processes of one thread
each, so it uses that many cores against pfl's one. ``--device cuda`` runs both sides on the
GPU (pfl through ``PFL_PYTORCH_DEVICE=cuda``, radbo through ``[runtime] device = "cuda"``;
``processes`` is CPU-only and is left out there).

The radbo side: ``[algorithm] name = "fedavg"`` with ``local_steps = 5``, ``batch_size =
7``, ``outer_batch_size = 3`` and ``lr = 0.1``: 5 steps of 10 examples, the work of pfl's
epoch over 50 (radbo's FedAvg draws each step's batch anew, without replacement, 7 from the
client's 35 inner and 3 from its 15 outer examples at ``outer_fraction = 0.3``, so a round is
the same arithmetic but not a permutation of the client's data; the server step with the same
``lr`` on the summed gradients is the average of the clients' models, pfl's central SGD with
rate 1);
``[task] name = "hyper_representation"`` with ``inner_l2 = 0`` (plain cross-entropy);
``[partition] kind = "iid"`` over ``--clients`` clients; ``[mask] policy = "none"``;
``[fleet] clients_per_round = --per-round``; no baseline run. radbo's zoo has no model of
pfl's ``simple_cnn`` architecture, so this script registers one as a plug-in kind of the
``[model]`` section (``name = "pfl_simple_cnn"``, :class:`PflSimpleCNN`): the same layers and
initialisation, without the two dropout layers (radbo's client loops have no random layers).
Dropout is masks over 12,544 and 128 activations per image: pfl's local step (forward,
backward, SGD step on a batch of 10, one thread) took 18.4 ms with it and 18.2 ms without it
in an alternated micro-benchmark on the machine of BENCHMARKS.md, so leaving it out flatters
radbo's ratio by about 1 %.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_pfl.py              # the issue's size
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_pfl.py --rounds 6 --repeats 3
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_pfl.py --device cuda
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_pfl.py --quick --skip-pfl
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_pfl.py --rounds 4 --profile 25 \\
        --backends sequential:channels_last

``--quick`` is a tiny size (40 clients, 4 per round, 3 rounds, 1 repetition) for a smoke test;
``--skip-pfl`` runs the radbo side only (no virtual environment is made). Writes the table and
the command to ``--out`` (default ``runs/bench/vs_pfl.md``). ``--profile TOP`` compares
nothing: it runs each radbo side in this process, the last round under ``cProfile`` (this
process's functions only: the ``processes`` backend's workers are not seen), and prints the
``TOP`` functions by own time beside the floor of a round (:func:`profile_sides`).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radbo.models import MODELS, BilevelModel, ModelConfig  # noqa: E402
from radbo.models.functional import apply_layer  # noqa: E402

PFL_SIDE = Path(__file__).resolve().parent / "pfl_side.py"
PFL_REQUIREMENTS = ("pfl[pytorch]==0.6.0", "torch==2.13.0")
BACKENDS = ("sequential", "batched", "auto", "processes")
FORMATS = ("contiguous", "channels_last")  # [runtime] memory_format; a side "backend:format"
GRAPHS = "cuda_graphs"  # a side "batched[:format]:cuda_graphs": [runtime] cuda_graphs = true


def side_parts(side: str) -> tuple[str, str, bool]:
    """``"sequential:channels_last"`` -> ``("sequential", "channels_last", False)``,
    ``"batched:cuda_graphs"`` -> ``("batched", "contiguous", True)``: the backend, the memory
    format (a bare backend is contiguous) and whether CUDA graphs replay its phases."""
    backend, *options = side.split(":")
    graphs = bool(options) and options[-1] == GRAPHS
    if graphs:
        options.pop()
    return backend, ":".join(options) or "contiguous", graphs


PER_CLIENT = 50  # pfl's mean_datapoints_per_user (constant)
STEPS = 5  # one local epoch of 50 examples in batches of 10
FULL_SIZE = {"clients": 1000, "per_round": 50, "rounds": 6, "repeats": 3}  # pfl's set-up
TEST_IMAGES = 100  # radbo needs a test split; it is never evaluated here
IMAGE_SHAPE = (32, 32, 3)
CLASSES = 10


# ------------------------------------------------------------------------- the radbo model
class PflSimpleCNN(BilevelModel):
    """pfl-research's benchmark ``simple_cnn`` as a radbo model, without its dropout layers:
    ``conv3x3(32) -> ReLU -> conv3x3(64) -> ReLU -> maxpool2 -> flatten -> fc(128) -> ReLU ->
    head``, Glorot-uniform weights. The convs and the hidden layer are x, ``head`` is y
    (FedAvg trains them alike). 1,626,442 parameters on 3x32x32 images.

    >>> model = PflSimpleCNN()
    >>> sum(p.numel() for p in model.parameters()), tuple(model(model.example_input(2)).shape)
    (1626442, (2, 10))
    """

    inner_modules = ("head",)
    output_layers = ("head",)

    def __init__(self, classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        pooled = (image_size - 4) // 2
        if pooled < 1 or classes < 1 or in_channels < 1:
            raise ValueError(f"needs images of at least 6x6 and positive sizes, got {image_size}")
        self.input_shape = (in_channels, image_size, image_size)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3),
            nn.ReLU(),
            nn.Conv2d(32, 64, 3),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.body = nn.Sequential(nn.Linear(64 * pooled * pooled, 128), nn.ReLU())
        self.head = nn.Linear(128, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.xavier_uniform_(m.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(torch.flatten(self.features(x), 1)))

    def _functional_forward(self, state: Mapping[str, Tensor], inputs: Tensor) -> Tensor:
        def body() -> Tensor:
            maps = apply_layer(self.features, "features.", state, inputs)
            return apply_layer(self.body, "body.", state, torch.flatten(maps, 1))

        return apply_layer(self.head, "head.", state, self._body(inputs, body))


class PflSimpleCNNConfig(ModelConfig):
    """``[model] name = "pfl_simple_cnn"``: :class:`PflSimpleCNN` (registered by this script)."""

    name: Literal["pfl_simple_cnn"]
    min_image_size: ClassVar[int] = 6

    def build(self, input_shape: tuple[int, ...], classes: int) -> PflSimpleCNN:
        channels, size = self.image(input_shape)
        return PflSimpleCNN(classes, channels, size)


def register_model() -> None:
    """Register ``[model] name = "pfl_simple_cnn"`` (once; called by the radbo side only, so
    that importing this file leaves radbo's registry as it was)."""
    if "pfl_simple_cnn" not in MODELS:
        MODELS.register(PflSimpleCNNConfig)


# ------------------------------------------------------------------------- data and venv
def write_data(folder: Path, clients: int, seed: int = 0) -> Path:
    """Synthetic CIFAR-shaped data for ``clients`` clients of 50 images (uint8 pixels, labels
    0-9, from ``seed``), as ``.npy`` for pfl and CIFAR-10 binary batches for radbo. Kept when
    ``folder`` already holds this size and seed."""
    n = clients * PER_CLIENT
    stamp = {"clients": clients, "per_client": PER_CLIENT, "seed": seed, "test": TEST_IMAGES}
    marker = folder / "synthetic.json"
    if marker.is_file() and json.loads(marker.read_text()) == stamp:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n + TEST_IMAGES, *IMAGE_SHAPE), dtype=np.uint8)
    labels = rng.integers(0, CLASSES, size=n + TEST_IMAGES).astype(np.uint8)
    np.save(folder / "images.npy", images[:n])
    np.save(folder / "labels.npy", labels[:n].astype(np.int64))
    # CIFAR-10 binary records: the label byte, then the red, green and blue planes
    records = np.concatenate(
        [labels[:, None], images.transpose(0, 3, 1, 2).reshape(len(images), -1)], axis=1
    )
    for i, part in enumerate(np.array_split(records[:n], 5), start=1):
        (folder / f"data_batch_{i}.bin").write_bytes(part.tobytes())
    (folder / "test_batch.bin").write_bytes(records[n:].tobytes())
    marker.write_text(json.dumps(stamp))
    return folder


def venv_python(path: Path) -> Path:
    return path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_pfl_venv(path: Path) -> Path:
    """The Python of the pfl environment at ``path``, made and filled first when missing."""
    python = venv_python(path)
    if not python.exists():
        print(f"creating {path} and installing {' '.join(PFL_REQUIREMENTS)} ...", file=sys.stderr)
        venv.EnvBuilder(with_pip=True, clear=True).create(path)
        pip = [str(python), "-m", "pip", "install", *PFL_REQUIREMENTS]
        subprocess.run(pip, check=True, stdout=sys.stderr)
    return python


def child_env(device: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env["PFL_PYTORCH_DEVICE"] = "cuda" if device.startswith("cuda") else "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def last_json(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise ValueError("no JSON line in the output")


# ------------------------------------------------------------------------- the radbo side
def radbo_config(
    data: Path,
    backend: str,
    clients: int,
    per_round: int,
    rounds: int,
    device: str,
    workers: int,
    memory_format: str = "contiguous",
    cuda_graphs: bool = False,
) -> dict[str, Any]:
    """The run config of the radbo side (see the module docstring)."""
    runtime: dict[str, Any] = {"backend": backend, "threads": 1, "device": device}
    if memory_format != "contiguous":
        runtime["memory_format"] = memory_format
    if cuda_graphs:
        runtime["cuda_graphs"] = True
    if backend == "processes":
        runtime["workers"] = workers
    return {
        "seed": 0,
        "rounds": rounds,
        "eval_every": rounds,
        "output_dir": str(Path(tempfile.gettempdir()) / "radbo-vs-pfl"),
        "data": {"name": "cifar10", "root": str(data), "outer_fraction": 0.3},
        "partition": {"kind": "iid"},
        "model": {"name": "pfl_simple_cnn"},
        "task": {"name": "hyper_representation", "inner_l2": 0.0},
        "fleet": {"num_clients": clients, "clients_per_round": per_round},
        "mask": {"policy": "none"},
        "algorithm": {
            "name": "fedavg",
            "lr": 0.1,
            "local_steps": STEPS,
            "batch_size": 7,
            "outer_batch_size": 3,
        },
        "baseline": {"enabled": False},
        "runtime": runtime,
    }


def radbo_side(
    data: Path,
    backend: str,
    *,
    clients: int,
    per_round: int,
    rounds: int,
    device: str = "cpu",
    workers: int = 2,
    memory_format: str = "contiguous",
    cuda_graphs: bool = False,
    profile_top: int = 0,
) -> dict[str, Any]:
    """Build radbo's FedAvg run for ``backend`` (``[runtime] memory_format``:
    ``memory_format``, ``[runtime] cuda_graphs``: ``cuda_graphs``) in this process, run
    ``rounds`` rounds of :meth:`Simulation.step` and return the seconds of each and the median
    of rounds 1.. Freed memory is kept for reuse first
    (:func:`radbo.allocator.retain_freed_memory`), as ``radbo run`` does by default. With
    ``profile_top`` > 0 the last round runs under ``cProfile`` (its time is then left out of
    the median) and ``"profile"`` holds the ``profile_top`` functions with the most own time:
    where the round's time goes beyond the floor's arithmetic."""
    from radbo.allocator import retain_freed_memory
    from radbo.config import parse_config
    from radbo.experiment import build

    torch.set_num_threads(1)
    register_model()
    config = parse_config(
        radbo_config(
            data, backend, clients, per_round, rounds, device, workers, memory_format, cuda_graphs
        )
    )
    if config.runtime.allocator == "retain":  # as radbo.run does (the default)
        retain_freed_memory()
    exp = build(config)
    sim, state = exp.simulation, exp.initial_state
    cuda = device.startswith("cuda")
    seconds = []
    profiler = cProfile.Profile() if profile_top > 0 else None
    try:
        for q in range(rounds):
            profiled = profiler is not None and q == rounds - 1
            start = time.perf_counter()
            if profiled:
                profiler.enable()
            state, record = sim.step(state, q)
            if cuda:
                torch.cuda.synchronize()
            if profiled:
                profiler.disable()
            seconds.append(time.perf_counter() - start)
            if len(record.clients) != per_round:
                raise RuntimeError(f"round {q} ran {len(record.clients)} clients, not {per_round}")
    finally:
        close = getattr(sim.backend, "close", None)
        if callable(close):
            close()
    timed = seconds[:-1] if profiler is not None and rounds > 1 else seconds
    steady = timed[1:] or timed
    result = {
        "side": "radbo",
        "backend": backend,
        "memory_format": memory_format,
        "cuda_graphs": cuda_graphs,
        "device": device,
        "threads": torch.get_num_threads(),
        "round_s": seconds,
        "s_per_round": statistics.median(steady),
    }
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile_top)
        result["profile"] = out.getvalue()
    return result


# ------------------------------------------------------------------------- the floor
def floor_seconds(
    per_round: int,
    device: str = "cpu",
    steps: int = 30,
    seed: int = 0,
    memory_format: torch.memory_format = torch.contiguous_format,
    compiled: bool = False,
) -> float:
    """The arithmetic of a round in plain PyTorch: the median time of one local step on a batch
    of 10 (``PflSimpleCNN`` as an ``nn.Module``, mean cross-entropy, ``loss.backward()``,
    ``torch.optim.SGD(lr=0.1).step()``, in place) times the round's 5 steps per client and
    ``per_round`` clients. Neither side can do a round's work faster with these kernels; what
    each spends above it is its own overhead (data handling, copies, aggregation).
    ``memory_format=torch.channels_last`` hands the model its images in NHWC layout, as radbo's
    ``[runtime] memory_format = "channels_last"`` does (the weights keep theirs).
    ``compiled``: the model's forward pass through ``torch.compile`` (AOTAutograd compiles its
    backward too); the first 3 steps, which compile, are left out like every side's warm-up."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    module = PflSimpleCNN().to(device)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    model = torch.compile(module) if compiled else module
    images = torch.rand(10, 3, 32, 32, generator=gen).to(device)
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(0, CLASSES, (10,), generator=gen).to(device)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[3:]) * STEPS * per_round


# ------------------------------------------------------------------------- the comparison
def run_child(command: list[str], env: Mapping[str, str], what: str) -> dict[str, Any]:
    done = subprocess.run(command, env=dict(env), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    try:
        return last_json(done.stdout)
    except ValueError:
        sys.exit(f"{what} printed no result:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA)"
    return f"{cpu_model()}, 1 thread per process"


def summary(values: Sequence[float]) -> str:
    mid = statistics.median(values)
    if len(values) == 1:
        return f"{mid:.2f}"
    return f"{mid:.2f} ({min(values):.2f}-{max(values):.2f})"


def table(
    pfl: list[float],
    radbo: Mapping[str, list[float]],
    floor: list[float],
    device: str,
    workers: int,
    floor_nhwc: Sequence[float] = (),
    floor_compiled: Sequence[float] = (),
) -> str:
    """Markdown: one row per radbo side, then pfl's and the plain-PyTorch floor (and the
    floor with channels-last images, and with the model compiled, when measured); "/ floor" is
    to the eager contiguous one."""
    lines = [
        "| side | s/round | radbo / pfl | / floor | device |",
        "|---|---:|---:|---:|---|",
    ]
    where = device_name(device)
    pfl_mid = statistics.median(pfl) if pfl else float("nan")
    floor_mid = statistics.median(floor) if floor else float("nan")
    for side, values in radbo.items():
        backend, memory_format, graphs = side_parts(side)
        label = f"radbo {backend}" + (f" ({workers} workers)" if backend == "processes" else "")
        label += ", channels-last" if memory_format == "channels_last" else ""
        label += ", CUDA graphs" if graphs else ""
        mid = statistics.median(values)
        to_pfl = f" {mid / pfl_mid:.2f}x " if pfl else " "  # --skip-pfl: nothing to compare
        lines.append(f"| {label} | {summary(values)} |{to_pfl}| {mid / floor_mid:.2f}x | {where} |")
    if pfl:
        lines.append(f"| pfl 0.6.0 | {summary(pfl)} | | {pfl_mid / floor_mid:.2f}x | {where} |")
    if floor:
        lines.append(f"| plain PyTorch floor | {summary(floor)} | | 1.00x | {where} |")
    for variant, values in (("channels-last", floor_nhwc), ("torch.compile", floor_compiled)):
        if values:
            mid = statistics.median(values)
            lines.append(
                f"| plain PyTorch floor, {variant} | {summary(values)} | | "
                f"{mid / floor_mid:.2f}x | {where} |"
            )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, help="clients of 50 images (default 1000)")
    parser.add_argument("--per-round", type=int, help="clients per round (default 50)")
    parser.add_argument("--rounds", type=int, help="rounds per run, the first a warm-up (6)")
    parser.add_argument("--repeats", type=int, help="alternated runs of each side (default 3)")
    parser.add_argument(
        "--backends",
        default=",".join(BACKENDS),
        help='radbo backends, each optionally ":channels_last" ([runtime] memory_format); '
        '"batched:cuda_graphs" on a GPU: [runtime] cuda_graphs',
    )
    parser.add_argument("--workers", type=int, default=2, help="workers of radbo's processes")
    parser.add_argument("--device", default="cpu", help='"cpu" or "cuda" (both sides)')
    parser.add_argument("--venv", default=str(ROOT / ".venv-pfl"), help="pfl's environment")
    parser.add_argument("--data", default=str(ROOT / "runs/bench/vs_pfl_data"), help="data dir")
    parser.add_argument("--out", default=str(ROOT / "runs/bench/vs_pfl.md"), help="markdown")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    parser.add_argument("--quick", action="store_true", help="tiny size for a smoke test")
    parser.add_argument("--skip-pfl", action="store_true", help="radbo side only, no venv")
    parser.add_argument(
        "--floor-compiled", action="store_true", help="also the floor with torch.compile"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="TOP",
        help="instead of the comparison: each radbo side in this process, its last round "
        "under cProfile, the TOP functions by own time beside the floor",
    )
    parser.add_argument("--side", choices=["radbo"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:  # the tiny size, where a flag does not say otherwise
        quick = {"clients": 40, "per_round": 4, "rounds": 3, "repeats": 1}
        for key, value in quick.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    for key, value in FULL_SIZE.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.profile < 0:
        parser.error("--profile must be >= 0")
    if min(args.clients, args.per_round, args.rounds, args.repeats, args.workers) < 1:
        parser.error("--clients, --per-round, --rounds, --repeats and --workers must be >= 1")
    if args.per_round > args.clients:
        parser.error("--per-round must be at most --clients")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error('--device must be "cpu" or "cuda[:N]"')
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible to torch here")
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(
        b
        for b in args.backends
        if side_parts(b)[0] not in BACKENDS or side_parts(b)[1] not in FORMATS
    )
    if unknown or not args.backends:
        parser.error(
            f"--backends takes some of {', '.join(BACKENDS)} (each optionally "
            f'":channels_last", and batched ":cuda_graphs"), got {unknown}'
        )
    graphed = [b for b in args.backends if side_parts(b)[2]]
    if any(side_parts(b)[0] != "batched" for b in graphed):
        parser.error(f"--backends: only batched takes :cuda_graphs, got {graphed}")
    if graphed and not args.device.startswith("cuda"):
        parser.error("--backends: :cuda_graphs needs --device cuda")
    if args.device != "cpu":  # forked workers cannot share a GPU context
        args.backends = [b for b in args.backends if side_parts(b)[0] != "processes"]
    return args


def side_result(
    data: Path, args: argparse.Namespace, side: str, profile_top: int = 0
) -> dict[str, Any]:
    """:func:`radbo_side` for ``side`` (``backend[:format][:cuda_graphs]``, :func:`side_parts`)
    at the size, device and workers of ``args``."""
    backend, memory_format, graphs = side_parts(side)
    return radbo_side(
        data,
        backend,
        clients=args.clients,
        per_round=args.per_round,
        rounds=args.rounds,
        device=args.device,
        workers=args.workers,
        memory_format=memory_format,
        cuda_graphs=graphs,
        profile_top=profile_top,
    )


def profile_sides(data: Path, args: argparse.Namespace) -> str:
    """``--profile TOP``: for each side of ``--backends``, the plain-PyTorch floor of a round
    (in the side's image layout) before and after the side, built in this process
    (:func:`radbo_side`) with its last round under ``cProfile``; the round times and the
    ``TOP`` functions by own time, as text. One process, no alternation and no pfl: a map of
    where radbo's round spends its time beyond the floor, not a comparison."""
    parts = []
    floor_seconds(args.per_round, args.device)  # warm-up: a fresh process's first is slower
    for side in args.backends:
        nhwc = side_parts(side)[1] == "channels_last"
        fmt = torch.channels_last if nhwc else torch.contiguous_format
        floor = [floor_seconds(args.per_round, args.device, memory_format=fmt)]
        result = side_result(data, args, side, profile_top=args.profile)
        floor.append(floor_seconds(args.per_round, args.device, memory_format=fmt))
        rounds = ", ".join(f"{s:.2f}" for s in result["round_s"])
        parts.append(
            f"## radbo {side}: {result['s_per_round']:.3f} s per steady round (rounds: "
            f"{rounds}; the last profiled), floor {floor[0]:.3f} s per round before it and "
            f"{floor[1]:.3f} s after"
            f"{' (channels-last)' if nhwc else ''}, {device_name(args.device)}\n"
            f"{result['profile']}"
        )
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    data = Path(args.data)
    if args.side == "radbo":  # a child: every backend asked for, one JSON line each
        for side in args.backends:
            print(json.dumps(side_result(data, args, side)), flush=True)
        return
    if args.profile:
        write_data(data, args.clients, args.seed)
        print(profile_sides(data, args))
        return
    python = None if args.skip_pfl else ensure_pfl_venv(Path(args.venv))
    write_data(data, args.clients, args.seed)
    env = child_env(args.device)
    size = ["--rounds", str(args.rounds), "--per-round", str(args.per_round)]
    load_before = os.getloadavg()
    pfl: list[float] = []
    radbo: dict[str, list[float]] = {b: [] for b in args.backends}
    floor: list[float] = []
    nhwc = any(side_parts(b)[1] == "channels_last" for b in args.backends)
    floor_nhwc: list[float] = []
    floor_compiled: list[float] = []
    for rep in range(args.repeats):
        order = ["pfl", *args.backends] if rep % 2 == 0 else [*args.backends, "pfl"]
        for who in order:
            if who == "pfl" and python is None:
                continue
            # the floor before every side: on a machine whose speed drifts, its samples spread
            # over the whole repetition like the sides' rounds do
            floor.append(floor_seconds(args.per_round, args.device))
            line = f"repeat {rep + 1}/{args.repeats}: floor: {floor[-1]:.3f} s/round"
            if nhwc:
                cl = torch.channels_last
                floor_nhwc.append(floor_seconds(args.per_round, args.device, memory_format=cl))
                line += f", channels-last: {floor_nhwc[-1]:.3f} s/round"
            if args.floor_compiled:
                floor_compiled.append(floor_seconds(args.per_round, args.device, compiled=True))
                line += f", compiled: {floor_compiled[-1]:.3f} s/round"
            print(line, file=sys.stderr)
            if who == "pfl":
                assert python is not None
                command = [str(python), str(PFL_SIDE), "--data", str(data), *size]
                result = run_child(command, env, "the pfl side")
                pfl.append(result["s_per_round"])
            else:
                command = [sys.executable, __file__, "--side", "radbo", "--backends", who]
                command += ["--data", str(data), "--clients", str(args.clients), *size]
                command += ["--device", args.device, "--workers", str(args.workers)]
                result = run_child(command, env, f"the radbo side ({who})")
                radbo[who].append(result["s_per_round"])
            print(
                f"repeat {rep + 1}/{args.repeats}: {who}: {result['s_per_round']:.3f} s/round "
                f"(rounds: {', '.join(f'{s:.2f}' for s in result['round_s'])})",
                file=sys.stderr,
                flush=True,
            )
    load_after = os.getloadavg()
    flags = [f"--clients {args.clients}", f"--per-round {args.per_round}"]
    flags += [f"--rounds {args.rounds}", f"--repeats {args.repeats}"]
    flags += [f"--device {args.device}", f"--workers {args.workers}"]
    if list(args.backends) != list(BACKENDS):
        flags.append(f"--backends {','.join(args.backends)}")
    if args.skip_pfl:
        flags.append("--skip-pfl")
    if args.floor_compiled:
        flags.append("--floor-compiled")
    shown = "OMP_NUM_THREADS=1 .venv/bin/python benchmarks/vs_pfl.py " + " ".join(flags)
    text = (
        f"{table(pfl, radbo, floor, args.device, args.workers, floor_nhwc, floor_compiled)}\n\n"
        f"Seconds per round: median over {args.repeats} alternated runs of each side (range in "
        f"brackets) of each run's median steady round (rounds 1..{args.rounds - 1}); "
        f"{args.clients} clients of {PER_CLIENT} images, {args.per_round} per round; torch "
        f"{torch.__version__}, {len(os.sched_getaffinity(0))} CPUs; load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (1 min).\n\n"
        f"Command: `{shown}`\n"
    )
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"written to {shlex.quote(str(out))}", file=sys.stderr)


if __name__ == "__main__":
    main()
