"""Command line: ``radbo run CONFIG.toml``, ``radbo fleet``, ``radbo report``, ``radbo export``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from radbo.checkpoint import CheckpointError
from radbo.config import ConfigError, load_config
from radbo.devices.budget import DeviceTooSmallError
from radbo.export import ExportCheckError, ExportError
from radbo.report import ReportError

EXIT_CONFIG = 2
EXIT_CHECK = 1


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
    fleet = sub.add_parser("fleet", help="show the fleet of a config: devices, r, tau, memory fit")
    fleet.add_argument("config", help="path to the TOML run configuration")
    fleet.add_argument("--json", action="store_true", help="print JSON instead of a table")
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
    return parser


def _run(args: argparse.Namespace) -> int:
    from radbo.config import parse_config
    from radbo.experiment import run

    config = load_config(args.config)
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

    from radbo.experiment import fleet_table

    rows = fleet_table(load_config(args.config))
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


def _report(args: argparse.Namespace) -> int:
    from radbo.report import compare

    result = compare(args.runs, args.output)
    print(result.table)
    print(f"report: {result.markdown}")
    print(f"json:   {result.json}")
    print(f"plots:  {', '.join(str(p) for p in result.plots)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from radbo.export import export_submodels

    config = load_config(args.config)
    try:
        result = export_submodels(config, args.output, torch_export=args.torch_export)
    except ExportCheckError as err:
        _print_export(err.result.manifest)
        print(str(err), file=sys.stderr)
        return EXIT_CHECK
    _print_export(result.manifest)
    print(
        f"{len(result.clients)} clients, {result.manifest['submodels']} distinct submodels; "
        f"check passed (max |diff| {result.max_abs_diff:.3g})"
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
        print(
            f"{c['client']:>6}  {str(c['device'] or '-'):<24.24}  {str(c['tier'] or '-'):<10.10}  "
            f"{c['capacity']:>6.4g}  {c['local_steps']:>4}  {c['parameters']:>9}  "
            f"{c['bytes'] / 1e6:>8.3f}  {c['flops_per_step'] / 1e6:>10.2f}  "
            f"{c['max_abs_diff']:>9.2g}  {c['file']}{extra}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radbo`` command; returns the exit code: 2 for bad configs, run
    folders or output folders, 1 when ``radbo export``'s check fails."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "fleet":
            return _fleet(args)
        if args.command == "report":
            return _report(args)
        if args.command == "export":
            return _export(args)
    except (ConfigError, DeviceTooSmallError, CheckpointError, ReportError, ExportError) as err:
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG
    return 1  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
