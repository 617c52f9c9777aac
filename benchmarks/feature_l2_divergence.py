"""The ``feature_l2`` divergence case with the guard off, with the default guard (roll back
and damp) and with the default box on x (issue 15, items 4 and 5).

RABO on ``feature_l2``: the synthetic 20-feature binary problem of
``tests/simulation/test_divergence.py`` (600 examples, 5 informative features), ``T = 10``, float64,
no mask. Three runs of the same config: ``[algorithm] divergence = "off"`` with ``[task] max_log_l2
= "off"`` (the blow-up as it is), ``divergence = "rollback"`` (the default) with the box off, and
the default box (``max_log_l2 = "auto"``, x_j <= log(1 / inner_lr)) with the guard set to ``"stop"``
(it would say if the box let the run blow up). Reported per run: the validation loss (the round's
``outer_loss``: the clients' validation BCE; full-batch with the default ``--batch``) at its best
round and at the end, their ratio (the acceptance: <= 1.01), the first round whose loss rose above
10 x the best before it, the rollbacks and their step-size scale, max x at the end and the final
test loss.

    # the test's case: full batch, inner_lr 1, outer_lr 20, 100 rounds, one client (~20 s)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_l2_divergence.py
    # five clients; minibatches of 32 at inner_lr 0.5, outer_lr 5 (noisy: best vs end is noise)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_l2_divergence.py --clients 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_l2_divergence.py --batch 32 \\
        --inner-lr 0.5 --outer-lr 5 --rounds 400
    # the issue's run: inner_lr 0.1, x reaches the edge after ~1,600 rounds (~4 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/feature_l2_divergence.py --inner-lr 0.1 \\
        --outer-lr 9 --rounds 2000
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from radbo.experiment import run  # noqa: E402
from tests.simulation.test_divergence import case, write_problem  # noqa: E402

SETTINGS = (
    ("guard off, box off", "off", "off"),
    ("rollback (default), box off", "rollback", "off"),
    ("box auto (default), guard stop", "stop", "auto"),
)


def summary(result, seconds: float) -> dict[str, str]:
    losses = [row.get("outer_loss", math.nan) for row in result.rounds]
    finite = [v for v in losses if math.isfinite(v)]
    best = min(finite) if finite else math.nan
    low, blowup = math.inf, None
    for q, v in enumerate(losses):
        if blowup is None and not v <= 10 * low:
            blowup = q
        if math.isfinite(v):
            low = min(low, v)
    events = [row["divergence"] for row in result.rounds if "divergence" in row]
    x = result.state.x["log_l2"]
    return {
        "best": f"{best:.4f} (round {losses.index(best)})" if finite else "-",
        "end": f"{losses[-1]:.4g}",
        "end / best": f"{losses[-1] / best:.4f}" if finite else "-",
        "loss > 10 x best so far": "-" if blowup is None else str(blowup),
        "rollbacks": ", ".join(f"{e['round']} (x{e['lr_scale']:g})" for e in events) or "-",
        "max x": f"{float(x.max()):.4g}",
        "test loss": f"{result.final.get('test_loss', math.nan):.4g}",
        "time s": f"{seconds:.1f}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--inner-lr", type=float, default=1.0)
    parser.add_argument("--outer-lr", type=float, default=20.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = write_problem(Path(tmp) / "features20.svm")
        for label, divergence, box in SETTINGS:
            cfg = case(
                data,
                args.rounds,
                divergence=divergence,
                box=box,
                inner_lr=args.inner_lr,
                outer_lr=args.outer_lr,
                clients=args.clients,
                batch=args.batch,
            )
            start = time.perf_counter()
            try:
                result = run(cfg, progress=False, save=False)
            except Exception as err:  # "stop" says the box did not keep the run sound
                rows.append({"run": label, "end": f"stopped: {err}"})
                continue
            rows.append({"run": label, **summary(result, time.perf_counter() - start)})
    print(
        f"rounds {args.rounds}, clients {args.clients}, batch {args.batch}, "
        f"inner_lr {args.inner_lr:g}, outer_lr {args.outer_lr:g}\n"
    )
    keys = list(dict.fromkeys(k for row in rows for k in row))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(row.get(k, "") for k in keys) + " |")


if __name__ == "__main__":
    main()
