"""The summary ``radbo run`` prints after a run (:func:`summary_lines`).

A figure the run has no data for is not printed as 0: a run without device profiles has no
simulated clock, so its summary says so once instead of "simulated time: 0.0 s", and its
savings leave the time fraction out.
"""

from __future__ import annotations

import math
from typing import Any

from radbo.experiment.runner import RunResult

__all__ = ["summary_lines"]

_BASELINE_NAMES = {
    "fedmbo_style": "full-model FedMBO-style baseline",
    "fedmbo": "FedMBO baseline",
}
_NO_CLOCK = (
    "no simulated clock or energy: the fleet has no device profiles "
    "(set [fleet] devices, file or trace to simulate them)"
)


def _percent(fraction: Any) -> str:
    return "-" if fraction is None or math.isnan(fraction) else f"{fraction:.1%}"


def _fractions(savings: dict[str, Any], clock: bool) -> str:
    parts = [
        f"compute {_percent(savings['compute_fraction'])}",
        f"bytes {_percent(savings['bytes_fraction'])}",
    ]
    if clock:
        parts.append(f"simulated time {_percent(savings['time_fraction'])}")
    return ", ".join(parts)


def summary_lines(result: RunResult) -> list[str]:
    """The lines ``radbo run`` prints for ``result``: final accuracy and loss, communication
    rounds, rejected updates (when any), compute, bytes and simulated time (or why there is
    none), the savings against the paired baseline at equal rounds and at equal accuracy
    (:func:`radbo.cost.savings_at_accuracy`), and the files written."""
    final = result.final
    accuracy = f"{final.get('test_accuracy', float('nan')):.4f}"
    ci95 = final.get("test_accuracy_ci95")
    # few-shot: mean over test episodes and its 95 % interval (none from one episode: NaN)
    if ci95 is not None and math.isfinite(ci95):
        accuracy += (
            f" ± {final['test_accuracy_ci95']:.4f} (95% CI, {int(final['test_episodes'])} episodes)"
        )
    totals = result.totals
    clock = result.config.fleet.has_devices
    lines = [
        f"final test accuracy: {accuracy}",
        f"final test loss:     {final.get('test_loss', float('nan')):.4f}",
        f"communication rounds: {int(totals.get('communication_rounds', 0))}",
    ]
    if totals.get("rejected_updates"):
        lines.append(
            f"rejected client updates (NaN/Inf or wrong shape, not aggregated): "
            f"{int(totals['rejected_updates'])}"
        )
    cost = (
        f"compute: {totals.get('flops', 0) / 1e9:.3f} GFLOP   "
        f"bytes: {totals.get('bytes', 0) / 1e6:.3f} MB"
    )
    if clock:
        cost += f"   simulated time: {totals.get('sim_time_s', 0):.1f} s"
    lines.append(cost)
    if not clock:
        lines.append(_NO_CLOCK)
    if result.savings is not None and result.baseline is not None:
        base_name = _BASELINE_NAMES.get(result.config.baseline.algorithm, "baseline")
        base_acc = result.baseline.final.get("test_accuracy", float("nan"))
        lines.append(
            f"vs {base_name} (test accuracy {base_acc:.4f}), at equal rounds "
            f"({len(result.rounds)}): {_fractions(result.savings, clock)}"
        )
        at_accuracy = result.savings_at_accuracy
        if at_accuracy is not None:
            target = f"at equal accuracy {at_accuracy['target_accuracy']:.4f} (the worse final)"
            mine, base = at_accuracy["run"], at_accuracy["baseline"]
            if mine is None or base is None:
                names = ((result.config.algorithm.name, mine), ("baseline", base))
                missing = " and the ".join(name for name, spent in names if spent is None)
                lines.append(f"{target}: not reached by the {missing}")
            else:
                lines.append(f"{target}: {_fractions(at_accuracy, clock)}")
                lines.append(
                    f"  first reached after {mine['rounds']} rounds "
                    f"({result.config.algorithm.name}) and {base['rounds']} rounds (baseline)"
                )
    out = result.output_dir
    if out is not None:
        lines.append(f"results: {out / 'results.json'}")
        lines.append(f"metrics: {out / 'metrics.csv'}")
        lines.append(f"plot:    {out / 'accuracy.png'}")
        if result.config.logging.tensorboard:
            lines.append(f"tensorboard: {out / 'tensorboard'}")
    return lines
