"""Conformance battery: every algorithm, with every estimator it accepts, passes the same checks
(after optax's ``_common_test.py``).

For each case of :data:`CASES` -- together they cover every registered built-in algorithm and
every estimator each one accepts (``test_cases_cover_every_algorithm_and_estimator``):

* the same seed gives bitwise the same states and records; another seed does not;
* a full mask (every client at capacity 1 through the submodel path) equals dense training;
* state shapes and dtypes stay those of the initial state;
* a NaN update and a wrong-shape update are rejected, counted, and the state stays finite;
* a run resumed from a checkpoint equals the uninterrupted run;
* client work sent through Flower messages (an in-process fake grid) equals the engine;
* the batched backend equals the sequential one.

Cases cover the hyper-representation task on an MLP and the few-shot task on Conv-4 (episodes,
BatchNorm, static BN). Runs are tiny (4 clients, an MLP with 16 hidden units, 2 rounds) and in
float64, so that the
equivalence checks hold on any CPU: "bitwise" where the same operations run in the same
order, 1e-10 relative where a stacked cohort reduces in another order (the finite-difference
estimator divides rounding errors by its step mu = 1e-3, so it gets 1e-8). Measured
(batched vs sequential, every case, default / AVX2 / AVX-512 kernels): at most 1.0e-14 /
7.5e-15 / 5.4e-15 relative, the finite-difference cases at most 7.8e-16 / 4.2e-16 / 1.0e-13
(rafbo on AVX-512): 1e4 x below their bounds. The tests comparing
two code paths (full mask vs dense, batched vs sequential) carry the ``float_sensitive``
marker.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from radbo.algorithms import ALGORITHMS
from radbo.config import RunConfig, parse_config
from radbo.experiment import build, run
from radbo.masks import LeadingPolicy, StructurePlan
from radbo.masks.assigner import SubmodelAssigner
from radbo.simulation import AutoBackend, BatchedBackend
from tests.helpers import Recorder, assert_same_state, state_tensors, unclocked_rows
from tests.simulation.test_auto_backend import kind

BASE: dict[str, Any] = {
    "seed": 3,
    "rounds": 2,
    "eval_every": 1,
    "partition": {"kind": "iid"},
    "model": {"name": "mlp", "hidden": [16]},
    "fleet": {"num_clients": 4, "capacities": [1.0, 0.5]},
    "mask": {"policy": "importance"},
    # the reference arithmetic (the default "auto" stacks small models' families)
    "runtime": {"dtype": "float64", "backend": "sequential"},
}
FULL_MODEL = {"mask": {"policy": "none"}, "fleet": {"num_clients": 4, "capacities": [1.0]}}

#: name -> (algorithm section, estimator section or None, other overrides)
CASES: dict[str, tuple[dict, dict | None, dict]] = {
    "rabo-cg": ({"name": "rabo", "inner_steps": 3}, {"name": "cg", "max_iter": 5}, {}),
    "rabo-neumann": ({"name": "rabo", "inner_steps": 3}, {"name": "neumann", "terms": 4}, {}),
    # the outer phase's refit of y before eq. (7) (radbo's addition, issue 26)
    "rabo-cg-refit": (
        {"name": "rabo", "inner_steps": 3, "refit_steps": 2},
        {"name": "cg", "max_iter": 5},
        {},
    ),
    "rabo-first_order": (
        {"name": "rabo", "inner_steps": 3},
        {"name": "first_order", "inner_steps": 3},
        {},
    ),
    "rafbo-finite_difference": (
        {"name": "rafbo", "inner_steps": 3},
        {"name": "finite_difference", "num_coordinates": 6, "cg_iters": 4},
        {},
    ),
    "simfbo-autograd": ({"name": "simfbo", "local_steps": 3}, {"name": "autograd"}, {}),
    "shrofbo-autograd": (
        {"name": "shrofbo"},
        None,
        {"fleet": {"num_clients": 4, "local_steps": "uniform", "local_steps_range": [1, 3]}},
    ),
    "shrofbo-finite_difference": (
        {"name": "shrofbo", "local_steps": 2},
        {"name": "finite_difference", "hvp_mu": 1e-4},
        {},
    ),
    "shrofbo-first_order": (
        {"name": "shrofbo", "local_steps": 2},
        {"name": "first_order", "lam": 10.0},
        {},
    ),
    "fedmbo-autograd": (
        {"name": "fedmbo", "inner_steps": 2, "neumann_terms": 3, "clients_per_phase": 3},
        {"name": "autograd"},
        FULL_MODEL,
    ),
    "fedmbo-finite_difference": (
        {"name": "fedmbo", "inner_steps": 2, "neumann_terms": 3},
        {"name": "finite_difference"},
        FULL_MODEL,
    ),
    "fedmsa-autograd": ({"name": "fedmsa", "local_steps": 3}, None, FULL_MODEL),
    "fedmsa-finite_difference": (
        {"name": "fedmsa", "local_steps": 2},
        {"name": "finite_difference"},
        FULL_MODEL,
    ),
    "fedavg": ({"name": "fedavg", "local_steps": 3}, None, {}),
    "fednest-autograd": (
        {
            "name": "fednest",
            "inner_steps": 2,
            "local_steps": 2,
            "outer_local_steps": 2,
            "neumann_terms": 3,
            "clients_per_phase": 3,
        },
        {"name": "autograd"},
        FULL_MODEL,
    ),
    "fednest-finite_difference": (
        {"name": "fednest", "local_steps": 2, "outer_local_steps": 2, "neumann_terms": 3},
        {"name": "finite_difference"},
        FULL_MODEL,
    ),
    "lfednest-autograd": (
        {
            "name": "lfednest",
            "inner_steps": 2,
            "local_steps": 2,
            "outer_local_steps": 2,
            "neumann_terms": 3,
            "clients_per_phase": 3,
        },
        {"name": "autograd"},
        FULL_MODEL,
    ),
    "lfednest-finite_difference": (
        {"name": "lfednest", "local_steps": 2, "outer_local_steps": 2, "neumann_terms": 3},
        {"name": "finite_difference"},
        FULL_MODEL,
    ),
    "aggitd-autograd": (
        {"name": "aggitd", "inner_rounds": 2, "clients_per_phase": 3},
        {"name": "autograd"},
        {
            "mask": {"policy": "none"},
            "fleet": {
                "num_clients": 4,
                "capacities": [1.0],
                "local_steps": "uniform",
                "local_steps_range": [1, 3],
            },
        },
    ),
    "aggitd-finite_difference": (
        {"name": "aggitd", "inner_rounds": 2, "local_steps": 2},
        {"name": "finite_difference"},
        FULL_MODEL,
    ),
    "fedsvrbgd_fo-first_order": (
        {"name": "fedsvrbgd_fo", "local_steps": 3, "eta": 0.1, "alpha_x": 1.0, "alpha_y": 1.0},
        {"name": "first_order", "lam": 5.0},
        {},
    ),
    "fedsvrbgd_fo-uneven_steps": (
        {"name": "fedsvrbgd_fo", "momentum": 0.5},
        None,
        {"fleet": {"num_clients": 4, "local_steps": "uniform", "local_steps_range": [1, 3]}},
    ),
    "rabo-cg-few_shot": (
        {"name": "rabo", "inner_steps": 2},
        {"name": "cg", "max_iter": 3},
        {
            "model": {"name": "conv4", "width": 4, "batchnorm": "static"},
            "task": {"name": "few_shot", "ways": 5, "shots": 1, "queries": 3, "test_episodes": 20},
        },
    ),
    "fedavg-few_shot": (
        {"name": "fedavg", "local_steps": 2},
        None,
        {
            "model": {"name": "conv4", "width": 4},
            "task": {"name": "few_shot", "ways": 5, "shots": 1, "queries": 3, "test_episodes": 20},
        },
    ),
    "protonet-few_shot": (
        {"name": "protonet", "local_steps": 2},
        None,
        {
            "model": {"name": "conv4", "width": 4},
            "task": {
                "name": "few_shot",
                "ways": 5,
                "shots": 2,
                "queries": 3,
                "test_episodes": 20,
                "prototypes": True,
            },
        },
    ),
    "maml-few_shot": (
        {"name": "maml", "local_steps": 2, "inner_steps": 2},
        None,
        {
            "model": {"name": "conv4", "width": 4},
            "task": {"name": "few_shot", "ways": 5, "shots": 1, "queries": 3, "test_episodes": 20},
        },
    ),
    "maml-first_order-few_shot": (
        {"name": "maml", "local_steps": 2, "inner_steps": 2, "first_order": True},
        None,
        {
            "model": {"name": "conv4", "width": 4, "batchnorm": "static"},
            "task": {"name": "few_shot", "ways": 5, "shots": 1, "queries": 3, "test_episodes": 20},
        },
    ),
}


def config(case: str, **extra: Any) -> RunConfig:
    algorithm, estimator, overrides = CASES[case]
    data = {**BASE, **overrides, "algorithm": algorithm, **extra}
    if estimator is not None:
        data["estimator"] = estimator
    return parse_config(data)


def rtol(case: str) -> float:
    """float64, batched vs sequential: a few hundred roundings per value over 2 rounds (~1e-13
    relative); a finite difference divides them by its step (mu >= 1e-4), hence 1e-8."""
    return 1e-8 if "finite_difference" in case else 1e-10


def trajectory(cfg: RunConfig, backend=None, masks=None) -> list:
    exp = build(cfg)
    if backend is not None:
        exp.simulation.backend = backend
    if masks is not None:
        exp.simulation.masks = masks(exp)
    return list(exp.simulation.iterate(exp.initial_state, cfg.rounds))


def assert_bitwise(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (sa, ra), (sb, rb) in zip(a, b, strict=True):
        assert_same_state(sa, sb, tensors_only=True)
        assert ra.ledger == rb.ledger
        assert ra.evaluation == rb.evaluation
        ma, mb = dict(ra.metrics), dict(rb.metrics)
        assert ma.keys() == mb.keys()
        for k in ma:
            assert ma[k] == mb[k] or (ma[k] != ma[k] and mb[k] != mb[k]), k  # NaN == NaN


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(a.abs().max()), 1e-300)


# ------------------------------------------------------------------------------- coverage
def test_cases_cover_every_algorithm_and_estimator() -> None:
    # a variant's case (RAFBO, ShroFBO, LFedNest: a registered subclass running its base's
    # code with that estimator) covers its registered base kinds too
    registered = ALGORITHMS.classes()
    covered = {
        (base, e["name"] if e else None)
        for a, e, _ in CASES.values()
        for base in ALGORITHMS[a["name"]].__mro__
        if base in registered
    }
    for tag in ALGORITHMS:
        cls = ALGORITHMS[tag]
        if not cls.__module__.startswith("radbo."):
            continue  # a plug-in registered by another test
        assert any(c is cls for c, _ in covered), f"no case for algorithm {tag}"
        instance = config(next(k for k, (a, _, _) in CASES.items() if a["name"] == tag)).algorithm
        for est in instance.accepted_estimators():
            default = (cls, None) in covered and est == cls.default_estimator
            assert (cls, est) in covered or default, f"no case for {tag} with estimator {est}"


# ------------------------------------------------------------------------------- the checks
@pytest.mark.parametrize("case", CASES)
def test_same_seed_same_run_other_seed_other_run(case: str) -> None:
    cfg = config(case)
    first, second = trajectory(cfg), trajectory(cfg)
    assert_bitwise(first, second)
    other = trajectory(config(case, seed=4))
    a, b = state_tensors(first[-1][0]), state_tensors(other[-1][0])
    assert any(a[k].is_floating_point() and not torch.equal(a[k], b[k]) for k in a)


@pytest.mark.float_sensitive
@pytest.mark.parametrize("case", CASES)
def test_full_mask_equals_dense(case: str) -> None:
    """Every client at capacity 1 through the submodel path (index sets that keep every
    channel, skeletons built by the structure plan) equals dense training bitwise: the
    skeletons have the dense shapes, so the same kernels run in the same order on any CPU."""
    cfg = config(case, mask={"policy": "none"}, fleet={"num_clients": 4, "capacities": [1.0]})

    def full_masks(exp):
        model = exp.model
        plan = StructurePlan(model, model.example_input(1), output_layers=model.output_layers)
        exp.simulation.runtime.build_submodel = plan.submodel
        return SubmodelAssigner(plan, LeadingPolicy(), model.outer_param_names())

    dense = trajectory(cfg)
    masked = trajectory(cfg, masks=full_masks)
    assert_bitwise(dense, masked)


@pytest.mark.parametrize("case", CASES)
def test_state_shapes_and_dtypes_stay_those_of_the_initial_state(case: str) -> None:
    cfg = config(case)
    exp = build(cfg)
    initial = state_tensors(exp.initial_state)
    for state, _ in exp.simulation.iterate(exp.initial_state, cfg.rounds):
        now = state_tensors(state)
        for k, t in now.items():
            if k.startswith("chains/"):
                continue  # FedMBO's Neumann chains live within one iteration
            assert k in initial, k
            assert (t.shape, t.dtype) == (initial[k].shape, initial[k].dtype), k
        model = exp.simulation.algorithm.model_state(state)
        assert {k: (t.shape, t.dtype) for k, t in model.items()} == {
            k: (t.shape, t.dtype) for k, t in exp.model.state_dict().items()
        }


def poison(task, result):
    """Client 1 answers with NaN, client 2 with a wrongly shaped tensor, in every phase."""
    if result.client in (1, 2) and result.update:
        name = next(iter(result.update))
        bad = result.update[name]
        spoiled = torch.full_like(bad, float("nan")) if result.client == 1 else bad[..., :0]
        return replace(result, update={**result.update, name: spoiled})
    return None


@pytest.mark.parametrize("case", CASES)
def test_nan_and_wrong_shape_updates_are_rejected_and_counted(case: str) -> None:
    cfg = config(case)
    rounds = trajectory(cfg, backend=Recorder(poison))
    rejected = 0
    for state, record in rounds:
        for phase, clients in record.rejected.items():
            assert set(clients) <= {1, 2}, phase
        took_part = {e.client for e in record.ledger if e.bytes_up > 0}
        expected = sum(
            1 for e in record.ledger if e.client in (1, 2) and e.bytes_up > 0
        )  # one rejection per poisoned reply
        assert record.metrics["rejected_updates"] == expected
        rejected += expected
        assert took_part
        for k, t in state_tensors(state).items():
            if t.is_floating_point():
                assert bool(torch.isfinite(t).all()), k
    assert rejected > 0


@pytest.mark.parametrize("case", CASES)
def test_resumed_run_equals_the_uninterrupted_one(case: str, tmp_path) -> None:
    whole = run(config(case, rounds=3), progress=False, save=False, output_dir=tmp_path / "a")
    out = tmp_path / "b"
    run(config(case, rounds=1, checkpoint_every=1), progress=False, save=False, output_dir=out)
    resumed = run(
        config(case, rounds=3, checkpoint_every=1),
        progress=False,
        save=False,
        output_dir=out,
        resume=True,
    )
    a, b = state_tensors(whole.state), state_tensors(resumed.state)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert whole.ledger == resumed.ledger
    assert unclocked_rows(whole.rounds) == unclocked_rows(resumed.rounds)


@pytest.mark.parametrize("case", CASES)
def test_flower_messages_give_the_engine_s_results(case: str, request) -> None:
    pytest.importorskip("flwr", reason="flwr is not installed (pip install 'radbo[flower]')")
    from radbo.flower import FlowerBackend
    from radbo.flower.apps import CONFIG_KEY
    from tests.flower.test_flower import FakeGrid

    request.getfixturevalue("flower_identity")  # after the skip: the fixture imports flwr
    cfg = config(case)
    nodes = {c: 300 + c for c in range(cfg.fleet.num_clients)}
    grid = FakeGrid({n: c for c, n in nodes.items()})
    backend = FlowerBackend(grid, nodes, extra={CONFIG_KEY: cfg.model_dump_json()})
    assert_bitwise(trajectory(cfg), trajectory(cfg, backend=backend))
    assert grid.sent


@pytest.mark.float_sensitive
@pytest.mark.parametrize("case", CASES)
def test_batched_backend_equals_sequential(case: str) -> None:
    cfg = config(case, fleet={**config(case).fleet.model_dump(), "num_clients": 4})
    seq, bat = trajectory(cfg), trajectory(cfg, backend=BatchedBackend())
    for (sa, ra), (sb, rb) in zip(seq, bat, strict=True):
        ta, tb = state_tensors(sa), state_tensors(sb)
        assert ta.keys() == tb.keys()
        for k in ta:
            if ta[k].is_floating_point():
                assert relative(ta[k], tb[k]) <= rtol(case), k
            else:
                assert torch.equal(ta[k], tb[k]), k
        assert ra.ledger == rb.ledger


@pytest.mark.parametrize("case", CASES)
def test_the_default_auto_backend_stacks_small_work_as_the_batched_backend(case: str) -> None:
    """Every algorithm and estimator under ``[runtime] backend = "auto"`` (the default): the
    MLP's operations are small, so every family it meets is stacked after one client's work
    is counted, and the run is the batched backend's bit for bit (float64 states, ledger,
    metrics): counting a client's work changes nothing the run computes."""
    fleet = {**config(case).fleet.model_dump(), "num_clients": 4}
    cfg = config(case, fleet=fleet)
    exp = build(config(case, fleet=fleet, runtime={"dtype": "float64"}))  # the default backend
    backend = exp.simulation.backend
    assert isinstance(backend, AutoBackend) and backend.choose == "size"
    auto = list(exp.simulation.iterate(exp.initial_state, cfg.rounds))
    assert_bitwise(trajectory(cfg, backend=BatchedBackend()), auto)
    assert set(backend.plan.values()) == {"stacked"}, backend.plan
    # one count per client work, whatever its group sizes (a family's name adds the size)
    assert backend.sizes.keys() == {kind(family) for family in backend.plan}


@pytest.mark.parametrize("case", CASES)
def test_broadcast_many_equals_broadcast_client_by_client(case: str) -> None:
    """A phase that builds every client's message at once (Phase.broadcast_many, which the
    engine calls instead of broadcast) sends each client exactly what broadcast sends it:
    the same keys, dtypes, shapes and values, for the round's real index sets (masked
    clients of several capacities) and a state after a round."""
    exp = build(config(case))
    sim = exp.simulation
    state, _ = sim.step(exp.initial_state, 0)
    sampled = list(range(len(exp.clients)))
    plan = sim._plan(state, 1, sampled)
    phases = [p for p in sim.algorithm.phases() if p.broadcast_many is not None]
    if CASES[case][0]["name"] in {"rabo", "rafbo", "fedavg", "simfbo", "shrofbo"}:
        assert phases, "this algorithm builds its broadcasts at once"
    for phase in phases:
        slots = list(range(len(sampled)))
        many = phase.broadcast_many(state, plan.index_sets, slots)
        for slot, index_set in enumerate(plan.index_sets):
            one = phase.broadcast(state, index_set, slot)
            assert list(many[slot]) == list(one), phase.name
            for k, t in one.items():
                got = many[slot][k]
                assert got.dtype == t.dtype and got.shape == t.shape, (phase.name, k)
                assert torch.equal(got, t), (phase.name, k)
