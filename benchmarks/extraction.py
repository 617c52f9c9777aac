"""Per-client cost of structured masks: index sets vs a physical submodel, and what it saves.

For each model and capacity ratio r in {1, 1/2, 1/4, 1/8} (every prunable group keeps
``kept_count(C, r)`` channels; the classifier's outputs are never pruned) it times, per client,

* (a) index sets only: ``plan.index_sets(policy(plan, ratios, ...))`` — what the server needs
  to slice, send and scatter back;
* (b) the physical submodel: ``plan.submodel(index_sets)`` — an ``nn.Module`` holding exactly
  the kept slices, needed to train or export it;

as the median of ``--repeats`` runs after ``--warmup`` runs, in milliseconds, with ``--threads``
torch threads (default 2, the 2-core target: index sets < 10 ms, a ResNet-18 submodel < 50 ms).
The policy is HeteroFL's ``leading`` (default) or RABO's L2 ``importance``; importance scores
are computed once per round (:class:`~radbo.masks.ImportancePolicy` caches them), so its
per-client cost is a top-k, and the one-off per-round scoring time is printed below the table.
It also gives the submodel's parameter count and the FLOPs of one forward + backward of
cross-entropy at batch 8 (:func:`radbo.flops.training_step_flops`, all parameters) as
fractions of r = 1. Run it on an otherwise idle machine: with other processes on the same two
cores, torch's OpenMP threads oversubscribe them and the times grow 5-10x (``--threads 1`` is
then the fairer measurement).

    .venv/bin/python benchmarks/extraction.py                     # resnet18, mlp, resnet12
    .venv/bin/python benchmarks/extraction.py --policy importance --models resnet18
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from radbo.flops import training_step_flops
from radbo.masks import ImportancePolicy, LeadingPolicy, MaskPolicy, StructurePlan
from radbo.models import CNN7, MLP, BilevelModel, ResNet12, ResNet18

MODELS: dict[str, tuple[str, Callable[[], BilevelModel]]] = {
    "resnet18": ("ResNet-18 (CIFAR, 3x32x32)", ResNet18),
    "mlp": ("MLP 784-200-10 (MNIST)", lambda: MLP(784, [200], 10)),
    "resnet12": ("ResNet-12 (64-160-320-640, 3x84x84)", ResNet12),
    "resnet12-omniglot": (
        "ResNet-12 (64-160-320-640, 1x28x28)",
        lambda: ResNet12(in_channels=1, image_size=28),
    ),
    "cnn7": ("CNN7 / LeNet-5 (CIFAR, 3x32x32)", CNN7),
}
POLICIES: dict[str, Callable[[], MaskPolicy]] = {
    "leading": LeadingPolicy,
    "importance": ImportancePolicy,
}
RATIOS = (1.0, 0.5, 0.25, 0.125)
FLOP_BATCH = 8


def _median_ms(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _ratio_label(r: float) -> str:
    return "1" if r == 1.0 else f"1/{round(1 / r)}"


def bench_model(
    key: str, policy_name: str, repeats: int, warmup: int
) -> tuple[list[dict[str, object]], float]:
    """Rows of the table for one model, and the one-off scoring time per round (ms)."""
    _, build = MODELS[key]
    model = build()
    plan = StructurePlan(model, model.example_input(1), model.output_layers)
    policy = POLICIES[policy_name]()
    generator = torch.Generator().manual_seed(0)
    scoring_ms = 0.0
    if isinstance(policy, ImportancePolicy):
        scoring_ms = _median_ms(lambda: plan.group_scores(policy.importance), 3, 1)
    full_params = sum(p.numel() for p in model.parameters())
    full_flops = training_step_flops(model, FLOP_BATCH)
    rows: list[dict[str, object]] = []
    for client, r in enumerate(RATIOS):
        ratios = {group: r for group in plan.groups}

        def index_sets(ratios: dict[str, float] = ratios, client: int = client) -> object:
            kept = policy(plan, ratios, round=0, client=client, generator=generator)
            return plan.index_sets(kept)

        idx = index_sets()
        t_idx = _median_ms(index_sets, repeats, warmup)
        t_sub = _median_ms(lambda idx=idx: plan.submodel(idx), repeats, warmup)
        sub = plan.submodel(idx)
        params = sum(p.numel() for p in sub.parameters())
        rows.append(
            {
                "r": r,
                "index_ms": t_idx,
                "submodel_ms": t_sub,
                "params": params,
                "param_ratio": params / full_params,
                "flop_ratio": training_step_flops(sub, FLOP_BATCH) / full_flops,
            }
        )
    return rows, scoring_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", choices=list(MODELS), default=["resnet18", "mlp", "resnet12"]
    )
    parser.add_argument("--policy", choices=list(POLICIES), default="leading")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    print(
        f"policy={args.policy}, torch threads={torch.get_num_threads()}, median of "
        f"{args.repeats} after {args.warmup} warm-up, FLOPs: forward+backward at batch "
        f"{FLOP_BATCH}, torch {torch.__version__}\n"
    )
    print(
        "| model | r | index sets (ms) | physical submodel (ms) | parameters | param. ratio "
        "| fwd+bwd FLOP ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    scoring: list[str] = []
    for key in args.models:
        rows, scoring_ms = bench_model(key, args.policy, args.repeats, args.warmup)
        if scoring_ms:
            scoring.append(f"{MODELS[key][0]}: {scoring_ms:.1f} ms")
        for row in rows:
            print(
                f"| {MODELS[key][0]} | {_ratio_label(float(row['r']))} "
                f"| {row['index_ms']:.2f} | {row['submodel_ms']:.2f} | {row['params']:,} "
                f"| {row['param_ratio']:.4f} | {row['flop_ratio']:.4f} |"
            )
    if scoring:
        print("\nImportance scores, once per round: " + "; ".join(scoring))


if __name__ == "__main__":
    main()
