"""Command line: ``radbo run CONFIG.toml``, ``radbo fleet``, ``radbo report``, ``radbo export``."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from radbo.limits import LATENCY_RUNS, caps_lifted
from radbo.tomlfile import read_toml

if TYPE_CHECKING:
    from radbo.config import RunConfig

EXIT_CONFIG = 2
EXIT_CHECK = 1

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


def _load(args: argparse.Namespace) -> RunConfig:
    """``args.config`` read (torch-free: a missing or malformed file fails fast) and then
    validated, which needs the config classes and so imports torch."""
    data = read_toml(args.config)
    from radbo.config import parse_config

    return parse_config(data)


_FORCE_HELP = (
    "accept values above the caps that guard against a run that would not end (rounds > "
    "1,000,000, > 10,000 steps per round, > 1,000,000 clients, step sizes > 1000); the "
    "physical bounds still hold"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radbo", description="Resource-aware federated bilevel optimization."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a simulated federated bilevel job from a TOML config")
    run.add_argument("config", help="path to the TOML run configuration")
    run.add_argument("--output-dir", help="where to write results (overrides output_dir)")
    run.add_argument("--rounds", type=int, help="override the number of rounds")
    run.add_argument("--seed", type=int, help="override the run seed")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoints in the output folder (see checkpoint_every)",
    )
    run.add_argument(
        "--checkpoint-every", type=int, help="write a checkpoint every N rounds (overrides)"
    )
    run.add_argument("--force", action="store_true", help=_FORCE_HELP)
    fleet = sub.add_parser("fleet", help="show the fleet of a config: devices, r, tau, memory fit")
    fleet.add_argument("config", help="path to the TOML run configuration")
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
    report = sub.add_parser(
        "report",
        help="compare finished runs: accuracy vs round, time, bytes, FLOPs; cost per tier",
    )
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="folders written by radbo run")
    report.add_argument(
        "--output",
        default="radbo-report",
        metavar="DIR",
        help="where to write the plots, report.md and report.json (default: ./radbo-report)",
    )
    export = sub.add_parser(
        "export",
        help="write each client's round-0 submodel (safetensors + manifest.json) and check it",
    )
    export.add_argument("config", help="path to the TOML run configuration")
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
    flower = sub.add_parser("flower", help="Flower deployments: write each node's own data")
    flower_sub = flower.add_subparsers(dest="flower_command", required=True)
    part = flower_sub.add_parser(
        "partition",
        help="write each client's examples to DIR/client-<i> for a SuperNode's data-root "
        '([flower] data = "node")',
    )
    part.add_argument("config", help="path to the TOML run configuration")
    part.add_argument("--out", required=True, metavar="DIR", help="where to write the folders")
    part.add_argument("--force", action="store_true", help=_FORCE_HELP)
    return parser


def _flower(args: argparse.Namespace) -> int:
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
    config = _load(args)
    from radbo.config import parse_config
    from radbo.experiment import run

    overrides = {
        k: v
        for k, v in (
            ("rounds", args.rounds),
            ("seed", args.seed),
            ("checkpoint_every", args.checkpoint_every),
        )
        if v is not None
    }
    if overrides:
        config = parse_config({**config.model_dump(), **overrides})
    result = run(config, progress=not args.quiet, output_dir=args.output_dir, resume=args.resume)
    final = result.final
    accuracy = f"{final.get('test_accuracy', float('nan')):.4f}"
    if "test_accuracy_ci95" in final:  # few-shot: mean over test episodes and its 95 % interval
        accuracy += (
            f" ± {final['test_accuracy_ci95']:.4f} (95% CI, {int(final['test_episodes'])} episodes)"
        )
    print(f"final test accuracy: {accuracy}")
    print(f"final test loss:     {final.get('test_loss', float('nan')):.4f}")
    totals = result.totals
    print(f"communication rounds: {int(totals.get('communication_rounds', 0))}")
    if totals.get("rejected_updates"):
        print(
            f"rejected client updates (NaN/Inf or wrong shape, not aggregated): "
            f"{int(totals['rejected_updates'])}"
        )
    print(
        f"compute: {totals.get('flops', 0) / 1e9:.3f} GFLOP   "
        f"bytes: {totals.get('bytes', 0) / 1e6:.3f} MB   "
        f"simulated time: {totals.get('sim_time_s', 0):.1f} s"
    )
    if result.savings is not None and result.baseline is not None:
        sv = result.savings
        base_acc = result.baseline.final.get("test_accuracy", float("nan"))
        print(
            f"vs full-model FedMBO-style baseline (test accuracy {base_acc:.4f}): "
            f"compute {sv['compute_fraction']:.1%}, bytes {sv['bytes_fraction']:.1%}, "
            f"simulated time {sv['time_fraction']:.1%}"
        )
    out = result.output_dir
    assert out is not None, "run() saves its results (save=True) and records where"
    print(f"results: {out / 'results.json'}")
    print(f"plot:    {out / 'accuracy.png'}")
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
    columns = [
        ("client", "{:>6}"),
        ("device", "{:<24.24}"),
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
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    import json

    config = _load(args)
    from radbo.export import calibrate

    result = calibrate(config, runs=args.runs)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.table())
    return 0


def _report(args: argparse.Namespace) -> int:
    from radbo.report import compare

    result = compare(args.runs, args.output)
    print(result.table)
    print(f"report: {result.markdown}")
    print(f"json:   {result.json}")
    print(f"plots:  {', '.join(str(p) for p in result.plots)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    config = _load(args)
    from radbo.export import ExportCheckError, export_submodels

    try:
        result = export_submodels(
            config,
            args.output,
            formats=args.format,
            torch_export=args.torch_export,
            quantize=args.quantize,
            latency_runs=args.latency_runs,
        )
    except ExportCheckError as err:
        _print_export(err.result.manifest)
        print(str(err), file=sys.stderr)
        return EXIT_CHECK
    _print_export(result.manifest)
    print(
        f"{len(result.clients)} clients, {result.manifest['submodels']} distinct submodels; "
        f"check passed (max |diff| {result.max_abs_diff:.3g})"
    )
    for problem in result.manifest["check"].get("unsupported", []):
        print(
            f"not exported: client-{problem['client']} as {problem['format']}: {problem['error']}"
        )
    print(f"manifest: {result.manifest_path}")
    return 0


def _print_export(manifest: dict) -> None:
    print(
        f"{'client':>6}  {'device':<24}  {'tier':<10}  {'r':>6}  {'tau':>4}  {'params':>9}  "
        f"{'MB':>8}  {'MFLOP/step':>10}  {'max|diff|':>9}  file"
    )
    for c in manifest["clients"]:
        te = c["torch_export"]
        extra = ""
        if te is not None:
            extra = (
                f" + {te['file']}" if te.get("file") else f" (torch.export failed: {te['error']})"
            )
        for key in ("pte", "onnx", "pte_int8"):
            record = c.get(key)
            if not record:
                continue
            if "error" in record:
                extra += f" ({key} failed)"
                continue
            latency = record.get("latency") or []
            speed = f", {latency[-1]['per_sample_s'] * 1e6:.1f} us/sample" if latency else ""
            if "max_abs_diff" in record:
                extra += f" + {record['file']} (|diff| {record['max_abs_diff']:.2g}{speed})"
            else:  # int8: compared with FP32, not held to the tolerance
                agree = record["top1_agreement"]
                extra += f" + {record['file']} (top-1 agrees with FP32 {agree:.1%}{speed})"
        print(
            f"{c['client']:>6}  {str(c['device'] or '-'):<24.24}  {str(c['tier'] or '-'):<10.10}  "
            f"{c['capacity']:>6.4g}  {c['local_steps']:>4}  {c['parameters']:>9}  "
            f"{c['bytes'] / 1e6:>8.3f}  {c['flops_per_step'] / 1e6:>10.2f}  "
            f"{c['max_abs_diff']:>9.2g}  {c['file'] or '-'}{extra}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radbo`` command; returns the exit code: 2 for what
    :data:`USER_ERRORS` names (bad configs, files, run or output folders; printed as one
    line per problem on stderr, without a traceback), 1 when ``radbo export``'s check fails."""
    args = _parser().parse_args(argv)
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
            return commands[args.command](args)
    except Exception as err:
        if not is_user_error(err):
            raise
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG
    finally:
        warnings.showwarning = shown


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


_PACKAGE = Path(__file__).resolve().parent
_SHOW_WARNING = warnings.showwarning


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
