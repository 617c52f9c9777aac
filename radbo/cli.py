"""Command line: ``radbo run CONFIG.toml``, ``radbo fleet``, ``radbo report``, ``radbo export``."""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from radbo.limits import LATENCY_RUNS, caps_lifted
from radbo.registry import ConfigError
from radbo.tomlfile import read_toml
from radbo.version import __version__

if TYPE_CHECKING:
    from radbo.config import RunConfig
    from radbo.experiment import RunResult
    from radbo.experiment.stop import RunStopped

EXIT_CONFIG = 2
EXIT_CHECK = 1
#: The exit code when stdout (or stderr) is a pipe whose reader has gone (``radbo fleet ... |
#: head -5``): 128 + SIGPIPE, what the shell reports for a command that the signal ended.
EXIT_PIPE = 141

#: Subcommands that read a CONFIG and take ``key.sub=value`` overrides after it.
OVERRIDABLE = ("run", "fleet", "export")
_OVERRIDE = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*=")

#: What ``main`` reports as one line on stderr with exit code 2: a config, fleet file, trace,
#: device profile, data, checkpoint, run folder or output folder radbo refuses, a run stopped
#: by its divergence guard, a dead worker process. Any other exception is a bug in radbo and
#: keeps its traceback. Named by module, and looked up only among the modules already
#: imported (an error is raised by an imported module): this module imports no torch, so a
#: config file that cannot be read or parsed is reported before torch is loaded.
USER_ERRORS: tuple[tuple[str, str], ...] = (
    ("radbo.registry", "ConfigError"),
    ("radbo.devices.profile", "ProfileError"),
    ("radbo.devices.budget", "DeviceTooSmallError"),
    ("radbo.data.partition", "FleetTooLargeError"),
    ("radbo.checkpoint", "CheckpointError"),
    ("radbo.experiment.lock", "RunFolderError"),  # a ConfigError too; named for the reader
    ("radbo.report", "ReportError"),
    ("radbo.export", "ExportError"),
    ("radbo.simulation.divergence", "DivergenceError"),
    ("radbo.simulation.processes", "ClientWorkerError"),
)


def is_user_error(err: BaseException) -> bool:
    """Whether ``err`` is one of :data:`USER_ERRORS` (reported as one line, exit code 2)."""
    return any(
        isinstance(err, getattr(sys.modules[module], name))
        for module, name in USER_ERRORS
        if module in sys.modules
    )


def _load(args: argparse.Namespace, settings: dict[str, object] | None = None) -> RunConfig:
    """``args.config`` read (torch-free: a missing or malformed file fails fast), its
    ``key.sub=value`` overrides (``args.overrides``) and then ``settings`` (what flags such
    as ``--rounds`` set) applied, and the result validated as a file is, which needs the
    config classes and so imports torch."""
    data = read_toml(args.config)
    from radbo.config import apply_overrides, parse_config

    data = apply_overrides(data, getattr(args, "overrides", None) or [])
    data.update(settings or {})
    return parse_config(data)


_OVERRIDES_HELP = (
    "settings that replace the file's, as TOML values: algorithm.inner_lr=0.2 "
    "fleet.num_clients=50 model.hidden=[64] task.name=few_shot (validated as the file is)"
)

_FORCE_HELP = (
    "accept values above the caps that guard against a run that would not end (rounds > "
    "1,000,000, > 10,000 steps per round, > 1,000,000 clients, step sizes > 1000); the "
    "physical bounds still hold"
)


def _parser() -> argparse.ArgumentParser:
    """The ``radbo`` command line: one subcommand per task, each parser built by its own
    ``_add_*`` step below."""
    parser = argparse.ArgumentParser(
        prog="radbo", description="Resource-aware federated bilevel optimization."
    )
    parser.add_argument("--version", action="version", version=_version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_fleet(sub)
    _add_report(sub)
    _add_export(sub)
    _add_flower(sub)
    return parser


def _add_run(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``radbo run CONFIG [KEY=VALUE ...]``: a simulated run (or one per ``--seeds``)."""
    run = sub.add_parser("run", help="run a simulated federated bilevel job from a TOML config")
    run.add_argument("config", help="path to the TOML run configuration")
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)
    run.add_argument("--output-dir", help="where to write results (overrides output_dir)")
    run.add_argument("--rounds", type=int, help="override the number of rounds")
    run.add_argument("--seed", type=int, help="override the run seed")
    run.add_argument("--quiet", action="store_true", help="no progress bar or progress lines")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoints in the output folder (see checkpoint_every)",
    )
    run.add_argument(
        "--checkpoint-every", type=int, help="write a checkpoint every N rounds (overrides)"
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run the output folder holds (results.json, checkpoints); without "
        "it such a folder is refused",
    )
    run.add_argument(
        "--seeds",
        nargs="+",
        metavar="SEED",
        help="run once per seed into OUTPUT/seed-<seed> and write the mean and 95%% "
        "confidence interval over them to OUTPUT/aggregate.json and aggregate.md",
    )
    run.add_argument("--force", action="store_true", help=_FORCE_HELP)


def _add_fleet(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``radbo fleet CONFIG``: the fleet of a config, or with ``--calibrate`` its latencies."""
    fleet = sub.add_parser("fleet", help="show the fleet of a config: devices, r, tau, memory fit")
    fleet.add_argument("config", help="path to the TOML run configuration")
    fleet.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)
    fleet.add_argument("--json", action="store_true", help="print JSON instead of a table")
    fleet.add_argument("--force", action="store_true", help=_FORCE_HELP)
    fleet.add_argument(
        "--calibrate",
        action="store_true",
        help="compare the simulator's per-sample compute time on this host (probe_host) with "
        "the latency of each submodel in ExecuTorch and ONNX Runtime (needs radbo[edge])",
    )
    fleet.add_argument(
        "--runs",
        type=int,
        default=LATENCY_RUNS,
        metavar="N",
        help=f"--calibrate: timed runs per figure, median taken (default {LATENCY_RUNS})",
    )


def _add_report(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``radbo report RUN_DIR ...``: plots and tables comparing finished runs."""
    report = sub.add_parser(
        "report",
        help="compare finished runs: accuracy vs rounds, communication rounds, time, bytes, "
        "FLOPs, energy; cost per tier; seeds of one config grouped (mean ± 95%% CI)",
    )
    report.add_argument(
        "runs",
        nargs="+",
        metavar="RUN_DIR",
        help="folders written by radbo run (the output of `radbo run --seeds` stands for its "
        "seed-<s> folders)",
    )
    report.add_argument(
        "--output",
        default="radbo-report",
        metavar="DIR",
        help="where to write the plots, report.md and report.json (default: ./radbo-report)",
    )
    report.add_argument(
        "--format",
        default="png",
        metavar="LIST",
        help="comma-separated figure formats: png, pdf, svg (default: png)",
    )
    report.add_argument(
        "--no-group",
        action="store_true",
        help="one curve and row per run, not per group of runs that differ only by seed",
    )


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``radbo export CONFIG|RUN_DIR``: each client's submodel, written and checked."""
    export = sub.add_parser(
        "export",
        help="write each client's submodel of a trained model (a run folder, a checkpoint) or "
        "of the initial model (a config), in every format asked for, and check it",
    )
    export.add_argument(
        "config",
        metavar="CONFIG|RUN_DIR",
        help="a finished run's folder (exports its final state, config from results.json), "
        "or a TOML run configuration (exports its initial model, or --checkpoint's state)",
    )
    export.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="export the state of this checkpoint folder of the run (e.g. "
        "RUN_DIR/checkpoints/run), with the masks of the round after it",
    )
    export.add_argument(
        "--accuracy-examples",
        type=int,
        default=10_000,
        metavar="N",
        help="test examples each submodel's accuracy is measured on, per runtime (default "
        "10000, the first of the test set; 0: none)",
    )
    export.add_argument(
        "--output",
        default="radbo-export",
        metavar="DIR",
        help="where to write the submodels and manifest.json (default: ./radbo-export)",
    )
    export.add_argument(
        "--torch-export",
        action="store_true",
        help="also write a torch.export program (client-<i>.pt2) per submodel",
    )
    export.add_argument(
        "--format",
        default="safetensors",
        metavar="LIST",
        help="comma-separated files to write per submodel: safetensors (weights), pte "
        "(ExecuTorch, XNNPACK), onnx; pte and onnx need radbo[edge] (default: safetensors)",
    )
    export.add_argument(
        "--quantize",
        choices=["int8"],
        help="also write an int8 ExecuTorch program (client-<i>.int8.pte; needs pte)",
    )
    export.add_argument(
        "--latency-runs",
        type=int,
        default=LATENCY_RUNS,
        metavar="N",
        help=f"timed runs per latency figure of a .pte / .onnx (default {LATENCY_RUNS}; 0: none)",
    )
    export.add_argument("--force", action="store_true", help=_FORCE_HELP)


def _add_flower(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``radbo flower partition|deploy-local``: Flower deployments."""
    flower = sub.add_parser(
        "flower", help="Flower deployments: write each node's own data, deploy on this machine"
    )
    flower_sub = flower.add_subparsers(dest="flower_command", required=True)
    part = flower_sub.add_parser(
        "partition",
        help="write each client's examples to DIR/client-<i> for a SuperNode's data-root "
        '([flower] data = "node")',
    )
    part.add_argument("config", help="path to the TOML run configuration")
    part.add_argument("--out", required=True, metavar="DIR", help="where to write the folders")
    part.add_argument("--force", action="store_true", help=_FORCE_HELP)
    local = flower_sub.add_parser(
        "deploy-local",
        help="run a config on a SuperLink and one SuperNode per client on 127.0.0.1 (flwr run)",
    )
    local.add_argument("config", help="path to the TOML run configuration")
    local.add_argument(
        "--output",
        metavar="DIR",
        help="results, node data, the Flower app and logs/ (default: the config's output_dir)",
    )
    local.add_argument(
        "--timeout", type=float, default=1800.0, metavar="S", help="stop the run after S seconds"
    )
    local.add_argument(
        "--node-config",
        metavar="TEMPLATE",
        help="node i's config as 'k=v ...' (TOML values, {i} = node index), instead of "
        "partition-id=i and the data written to DIR/nodes",
    )


def _flower(args: argparse.Namespace) -> int:
    if args.flower_command == "deploy-local":
        from radbo.flower.deploy import deploy_local_command

        return deploy_local_command(
            args.config, args.output, timeout_s=args.timeout, node_config=args.node_config
        )
    config = _load(args)
    from radbo.flower.nodedata import write_node_data

    folders = write_node_data(config, args.out)
    for folder in folders:
        print(folder)
    print(
        f"wrote the data of {len(folders)} clients; start SuperNode i with --node-config "
        f"'partition-id=i data-root=\"{Path(args.out).resolve()}/client-i\"'"
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.resume and args.overwrite:
        raise ConfigError(
            "config error: --resume continues the run in the output folder and --overwrite "
            "replaces it; give one of them"
        )
    seeds = _seeds(args)  # moves the KEY=VALUE words --seeds took to args.overrides
    settings = {
        k: v
        for k, v in (
            ("rounds", args.rounds),
            ("seed", args.seed),
            ("checkpoint_every", args.checkpoint_every),
        )
        if v is not None
    }
    config = _load(args, settings)
    from radbo.experiment import run
    from radbo.experiment.stop import RunAborted, RunStopped, exit_code, stop_on_signals

    # SIGINT / SIGTERM: finish the round, write a checkpoint and the results so far, one line
    try:
        with stop_on_signals():
            if seeds is not None:
                return _run_seeds(args, config, seeds)
            result = run(
                config,
                progress=not args.quiet,
                output_dir=args.output_dir,
                resume=args.resume,
                overwrite=args.overwrite,
                overrides=args.overrides,
            )
    except RunStopped as stop:
        print(_stopped_line(args, seeds, stop), file=sys.stderr)
        return exit_code(stop.signum)
    except RunAborted as abort:  # a second signal while stopping
        out = args.output_dir if args.output_dir is not None else config.output_dir
        print(
            f"radbo: {abort}, mid-round; {Path(out) / 'checkpoints'} keeps the last checkpoint "
            f"written, if any: {_resume_command(args, seeds)} continues from it",
            file=sys.stderr,
        )
        return exit_code(abort.signum)
    from radbo.experiment.summary import summary_lines

    print("\n".join(summary_lines(result)))
    return 0


def _resume_command(args: argparse.Namespace, seeds: list[int] | None) -> str:
    """The ``radbo run`` command that continues this one: its config, overrides and flags,
    ``--resume`` in place of ``--overwrite``."""
    import shlex

    words = ["radbo", "run", args.config, *(args.overrides or [])]
    if seeds is not None:
        words += ["--seeds", *(str(s) for s in seeds)]
    for flag, value in (
        ("--output-dir", args.output_dir),
        ("--rounds", args.rounds),
        ("--seed", args.seed),
        ("--checkpoint-every", args.checkpoint_every),
    ):
        if value is not None:
            words += [flag, str(value)]
    words += [flag for flag, on in (("--quiet", args.quiet), ("--force", args.force)) if on]
    return shlex.join([*words, "--resume"])


def _stopped_line(args: argparse.Namespace, seeds: list[int] | None, stop: RunStopped) -> str:
    """The one line ``radbo run`` prints when SIGINT / SIGTERM stopped it: when, where its
    checkpoint and results are, and the command that continues it."""
    line = f"radbo: {stop}"
    out = stop.output_dir
    if out is None:  # pragma: no cover - radbo run always saves
        return line
    saved = f"; results so far in {out / 'results.json'}" if stop.result.output_dir else ""
    return (
        f"{line}: checkpoint in {out / 'checkpoints'}{saved}; continue with "
        f"{_resume_command(args, seeds)}"
    )


def _seeds(args: argparse.Namespace) -> list[int] | None:
    """The seeds of ``--seeds`` (``None`` without it). ``--seeds`` takes every word after it,
    so ``--seeds 0 1 2 algorithm.inner_lr=0.2`` leaves the override among them: such words
    go to ``args.overrides``. A seed that is not an integer, or ``--seeds`` with ``--seed``
    or a ``seed=`` override, is a :class:`ConfigError`."""
    if args.seeds is None:
        return None
    seeds = []
    for word in args.seeds:
        if _OVERRIDE.match(word):
            args.overrides.append(word)
            continue
        for part in filter(None, word.split(",")):
            try:
                seeds.append(int(part))
            except ValueError:
                raise ConfigError(
                    f"config error: --seeds {part!r}: a seed is an integer >= 0 (--seeds 0 1 2)"
                ) from None
    if args.seed is not None or any(o.partition("=")[0].strip() == "seed" for o in args.overrides):
        raise ConfigError(
            "config error: --seeds sets the seed of each run; drop --seed / seed= from the "
            "command line"
        )
    if not seeds:
        raise ConfigError("config error: --seeds needs at least one seed (--seeds 0 1 2)")
    return seeds


def _run_seeds(args: argparse.Namespace, config: RunConfig, seeds: list[int]) -> int:
    from radbo.experiment.seeds import aggregate_table, run_seeds

    def report(seed: int, result: RunResult) -> None:
        accuracy = result.final.get("test_accuracy", float("nan"))
        folder = result.output_dir
        print(f"seed {seed}: final test accuracy {accuracy:.4f}   results: {folder}", flush=True)

    outcome = run_seeds(
        config,
        seeds,
        progress=not args.quiet,
        output_dir=args.output_dir,
        resume=args.resume,
        overwrite=args.overwrite,
        overrides=args.overrides,
        on_result=report,
    )
    print(f"mean ± 95% confidence interval (Student's t) over {len(seeds)} seeds:")
    for line in aggregate_table(outcome.aggregate):
        print(line)
    out = outcome.output_dir
    assert out is not None, "run_seeds() saves (save=True) and records where"
    print(f"aggregate: {out / 'aggregate.json'}, {out / 'aggregate.md'}")
    return 0


def _fleet(args: argparse.Namespace) -> int:
    import json

    if args.calibrate:
        return _calibrate(args)
    config = _load(args)
    from radbo.experiment import fleet_table

    rows = fleet_table(config)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    rows = [_tau_shown(row) for row in rows]
    rows, legend = _device_refs(rows)
    columns = [
        ("client", "{:>6}"),
        ("device", "{:<6}"),
        ("tier", "{:<10}"),
        ("capacity", "{:>6.4g}"),
        ("budget_capacity", "{:>6.4g}"),
        ("local_steps", "{:>5}"),
        ("memory_mb", "{:>9.3f}"),
        ("device_memory_mb", "{:>10.1f}"),
        ("memory_fits", "{!s:>5}"),
        ("availability", "{:>6.2f}"),
        ("window_share", "{:>6.3f}"),
        ("available_share", "{:>7.3f}"),
        ("round_time_s", "{:>9.3f}"),
    ]
    titles = {
        "client": "client",
        "device": "device",
        "tier": "tier",
        "capacity": "r",
        "budget_capacity": "r_mem",
        "local_steps": "tau",
        "memory_mb": "mem MB",
        "device_memory_mb": "dev MB",
        "memory_fits": "fits",
        "availability": "avail",
        "window_share": "window",
        "available_share": "t_avail",
        "round_time_s": "round s",
    }
    present = [(k, f) for k, f in columns if k in rows[0]]
    widths = [len(f.format(rows[0][k])) for k, f in present]
    head = [
        titles[k].ljust(w) if "<" in f else titles[k].rjust(w)
        for (k, f), w in zip(present, widths, strict=True)
    ]
    print("  ".join(head))
    for row in rows:
        print("  ".join(f.format(row[k]) for k, f in present))
    for line in legend:
        print(line)
    if "local_steps_range" in rows[0]:
        low, high = rows[0]["local_steps_range"]
        if rows[0]["local_steps_schedule"] == "uniform":
            print(f"tau: drawn once per client, uniform on {{{low}, ..., {high}}} (run seed)")
        else:
            mean = "; round s: its mean" if "round_time_s" in rows[0] else ""
            print(f"tau: drawn afresh every round, uniform on {{{low}, ..., {high}}}{mean}")
    return 0


def _device_refs(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """``rows`` with each device name replaced by a numbered reference (``[1]``, in order of
    first appearance) and the list of the full names, one line each, wrapped at 100 columns:
    device names run to 90 characters, and a column cut at 24 lost what told them apart."""
    import textwrap

    names: list[str] = []
    for row in rows:
        if row.get("device") not in (None, "-") and row["device"] not in names:
            names.append(row["device"])
    ref = {name: f"[{i + 1}]" for i, name in enumerate(names)}
    shown = [{**row, "device": ref.get(str(row.get("device")), "-")} for row in rows]
    legend = [
        line
        for name in names
        for line in textwrap.wrap(
            f"{ref[name]:>6}  {name}", width=100, subsequent_indent=" " * 8, break_on_hyphens=False
        )
    ]
    return shown, legend


def _tau_shown(row: dict) -> dict:
    """``row`` of :func:`radbo.experiment.fleet_table` as the table shows it: a τ drawn
    afresh every round (``local_steps`` ``None``) as its range ``low-high``."""
    if row["local_steps"] is None:
        low, high = row["local_steps_range"]
        return {**row, "local_steps": f"{low}-{high}"}
    return row


def _calibrate(args: argparse.Namespace) -> int:
    import json

    config = _load(args)
    from radbo.export import calibrate

    result = calibrate(config, runs=args.runs)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


def _report(args: argparse.Namespace) -> int:
    from radbo.report import compare

    result = compare(args.runs, args.output, formats=args.format, group=not args.no_group)
    print(result.table)
    for note in result.notes:  # a plot or line left out, and why, once each
        print(note)
    print(f"report: {result.markdown}")
    print(f"json:   {result.json}")
    print(f"plots:  {', '.join(str(p) for p in result.plots)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    target = Path(args.config)
    # a config file is read before torch is imported (a missing or malformed one fails fast)
    config = None if target.is_dir() else _load(args)
    from radbo.export import ExportCheckError, ExportError, export_run, export_submodels

    if target.is_dir() and getattr(args, "overrides", None):
        raise ExportError(
            f"export error: {target} is a run folder, whose config is the one it ran; "
            f"overrides ({' '.join(args.overrides)}) apply to a CONFIG.toml only"
        )

    options = dict(
        checkpoint=args.checkpoint,
        formats=args.format,
        torch_export=args.torch_export,
        quantize=args.quantize,
        latency_runs=args.latency_runs,
        accuracy_examples=args.accuracy_examples,
    )
    try:
        if config is None:  # a run folder: its config is in results.json
            result = export_run(target, args.output, **options)
        else:
            result = export_submodels(config, args.output, **options)
    except ExportCheckError as err:
        print(err.result.table())
        print(str(err), file=sys.stderr)
        return EXIT_CHECK
    print(result.table())
    check = result.manifest["check"]
    tolerance = check["tolerance"]
    within = "" if tolerance is None else f", derived tolerance {tolerance:.2g}"
    if check["tolerance_rule"] == "given" and tolerance is not None:
        within = f", tolerance {tolerance:.2g}"
    print(
        f"{len(result.clients)} clients, {result.manifest['submodels']} distinct submodels; "
        f"check passed (max |diff| {result.max_abs_diff:.3g}{within})"
    )
    for problem in check.get("unsupported", []):
        print(
            f"not exported: client-{problem['client']} as {problem['format']}: {problem['error']}"
        )
    print(f"files:    {result.out_dir}/client-<submodel>.<format>")
    print(f"manifest: {result.manifest_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radbo`` command; returns the exit code: 2 for what
    :data:`USER_ERRORS` names (bad configs, files, run or output folders; printed as one
    line per problem on stderr, without a traceback), 1 when ``radbo export``'s check fails,
    :data:`EXIT_PIPE` when the reader of its output has gone (``radbo fleet ... | head -5``):
    then quietly, as a command that SIGPIPE ends (Python's documentation on SIGPIPE)."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        closed = _closed_outputs()
        if not closed:  # a pipe of radbo's own (a worker's), not its output: a bug
            raise
        # what is still buffered for the closed pipe goes nowhere, without a second error
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in closed:
            os.dup2(devnull, fd)
        os.close(devnull)
        return EXIT_PIPE


def _closed_outputs() -> list[int]:
    """The file descriptors of stdout and stderr that are pipes (or sockets) whose reading
    end has closed: ``poll`` reports an error on the writing end. Without ``poll`` (Windows)
    stdout's is assumed to be the one."""
    import select

    fds = []
    for stream in (sys.stdout, sys.stderr):
        try:
            fds.append(stream.fileno())
        except (AttributeError, OSError, ValueError):  # a replaced stream (pytest's capture)
            continue
    if not hasattr(select, "poll"):
        return fds[:1]
    closed = []
    for fd in dict.fromkeys(fds):
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        if any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0)):
            closed.append(fd)
    return closed


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides after an option (radbo run CONFIG --rounds 3 fleet.num_clients=5), and those
    # of subcommands whose parser does not list them; a word that is no KEY=VALUE is refused
    # by the override parser, in one line
    words = [w for w in extra if not w.startswith("-")]
    if words and args.command in OVERRIDABLE and len(words) == len(extra):
        args.overrides = [*(getattr(args, "overrides", None) or []), *words]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    commands = {
        "run": _run,
        "fleet": _fleet,
        "report": _report,
        "export": _export,
        "flower": _flower,
    }
    shown = warnings.showwarning
    warnings.showwarning = _one_line_warning
    try:
        # --force lifts the caps for the whole command: the config, and the checks a run
        # makes when it is built (local steps a device budget gives)
        with caps_lifted(getattr(args, "force", False)):
            _check_paths(args)
            return commands[args.command](args)
    except Exception as err:
        if not is_user_error(err):
            raise
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG
    finally:
        warnings.showwarning = shown


#: The path arguments of each command (``args`` attribute, how the message names it).
_PATH_ARGS: dict[str, tuple[tuple[str, str], ...]] = {
    "run": (("config", "config file"), ("output_dir", "--output-dir")),
    "fleet": (("config", "config file"),),
    "report": (("runs", "run folder"), ("output", "--output")),
    "export": (
        ("config", "config file or run folder"),
        ("checkpoint", "--checkpoint"),
        ("output", "--output"),
    ),
    "flower": (("config", "config file"), ("out", "--out"), ("output", "--output")),
}


def _check_paths(args: argparse.Namespace) -> None:
    """Each path on the command line that no file system accepts (a NUL character, a name
    too long, a file where a folder is named, a loop of links): a :class:`ConfigError`
    naming it, before anything reads or writes it. A path that does not exist yet passes."""
    for attr, label in _PATH_ARGS.get(args.command, ()):
        value = getattr(args, attr, None)
        for path in value if isinstance(value, list) else [value]:
            if path is not None:
                _check_path(path, label)


def _check_path(path: str, label: str) -> None:
    problem = None
    if "\0" in path:
        problem = "a path cannot hold a NUL character"
    else:
        try:
            os.lstat(path)
        except FileNotFoundError:  # made by the command, or refused by it with its reason
            pass
        except OSError as err:
            problem = err.strerror or str(err)
        except ValueError as err:  # a name the file system encoding cannot hold
            problem = str(err)
    if problem is not None:
        raise ConfigError(f"config error: {label} {path!r}: {problem}")


def _one_line_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """radbo's own warnings (a checkpoint fallback, a divergence in "warn" mode) as one line
    ``warning: ...`` on stderr; other libraries' warnings as Python prints them."""
    if category.__module__.startswith("radbo") or filename.startswith(str(_PACKAGE)):
        print(f"warning: {message}", file=sys.stderr if file is None else file)
    else:
        _SHOW_WARNING(message, category, filename, lineno, file, line)


def _version_text() -> str:
    """``radbo --version``: radbo's version, and Python's and PyTorch's (read from the
    installed package's metadata, without importing torch)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch = version("torch")
    except PackageNotFoundError:
        torch = "not installed"
    return f"radbo {__version__} (Python {sys.version.split()[0]}, torch {torch})"


_PACKAGE = Path(__file__).resolve().parent
_SHOW_WARNING = warnings.showwarning


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
