"""Command line: ``radbo run CONFIG.toml``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from radbo.config import ConfigError, load_config

EXIT_CONFIG = 2


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
    return parser


def _run(args: argparse.Namespace) -> int:
    from radbo.config import parse_config
    from radbo.experiment import run

    config = load_config(args.config)
    overrides = {k: v for k, v in (("rounds", args.rounds), ("seed", args.seed)) if v is not None}
    if overrides:
        config = parse_config({**config.model_dump(), **overrides})
    result = run(config, progress=not args.quiet, output_dir=args.output_dir)
    final = result.final
    print(f"final test accuracy: {final.get('test_accuracy', float('nan')):.4f}")
    print(f"final test loss:     {final.get('test_loss', float('nan')):.4f}")
    print(f"communication rounds: {result.totals.get('communication_rounds', 0)}")
    print(f"results: {result.output_dir / 'results.json'}")
    print(f"plot:    {result.output_dir / 'accuracy.png'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``radbo`` command; returns the exit code (2 for bad configs)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
    except ConfigError as err:
        print(str(err), file=sys.stderr)
        return EXIT_CONFIG
    return 1  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
