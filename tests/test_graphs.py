"""``radbo.graphs.PhaseGraphs`` and ``[runtime] cuda_graphs`` without a GPU.

A CPU has no CUDA graphs: these tests run the cache's eager path (``capture=False``), which
pads the cohort, copies the inputs into the capture's own tensors, runs the first call's phase
function on them and cuts the outputs back, as a replay does; tests/test_cuda.py replays real
graphs.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import NamedTuple

import pytest
import torch

from radbo.client import Cohort
from radbo.config import ConfigError, parse_config
from radbo.experiment import build
from radbo.graphs import PhaseGraphs
from radbo.simulation import BatchedBackend
from tests.configs import demo_dict, small_config
from tests.simulation.test_batched import assert_runs_agree


class Pair(NamedTuple):
    a: torch.Tensor
    label: str


def phase(inputs):
    """Per client: ``2 a + sum(b)``, and ``b`` reversed; a label passed through."""
    a, rest = inputs["a"], inputs["rest"]
    return {"sum": Pair(2 * a + rest[0].sum(-1), "kept"), "flipped": [rest[0].flip(-1)]}


def test_padded_sizes_are_multiples_of_the_granule():
    """Multiples of 8, or of an eighth of the cohort rounded down to a power of two where that
    is larger (130: 16; 300: 32; 1,000: 64): less than 1/8 more clients."""
    graphs = PhaseGraphs(granule=8)
    sizes = [1, 7, 8, 9, 37, 130, 300, 1000]
    assert [graphs.padded_size(n) for n in sizes] == [8, 8, 8, 16, 40, 144, 320, 1024]
    assert [PhaseGraphs(granule=1).padded_size(n) for n in (5, 37)] == [5, 40]
    assert all(n <= graphs.padded_size(n) <= max(n + 7, n * 9 / 8) for n in range(1, 5000))


@pytest.mark.parametrize("settings", [(0, 2, 64), (8, 0, 64), (8, 2, 0)])
def test_bad_settings_are_refused(settings: tuple[int, int, int]):
    with pytest.raises(ValueError, match="granule, warmup and max_captures >= 1"):
        granule, warmup, most = settings
        PhaseGraphs(granule=granule, warmup=warmup, max_captures=most)


def test_the_least_recently_used_capture_goes_beyond_the_limit():
    graphs = PhaseGraphs(capture=False, max_captures=2)
    for key in ("one", "two", "one", "three"):
        graphs.run(key, phase, {"a": torch.ones(3), "rest": (torch.ones(3, 2),)}, 3)
    assert [k[0] for k in graphs._captures] == ["one", "three"]


def test_a_phase_runs_padded_and_comes_back_cut_to_the_cohort():
    """Cohorts of 3 and then 5 clients share one capture (both pad to 8); each gets its own
    clients' results, exactly, and the capture's inputs are not the caller's tensors."""
    graphs = PhaseGraphs(granule=8, capture=False)
    for clients in (3, 5):
        a = torch.arange(clients, dtype=torch.float64)
        b = torch.arange(clients * 4, dtype=torch.float64).view(clients, 4) * 0.5
        out = graphs.run("phase", phase, {"a": a, "rest": (b,)}, clients)
        assert out["sum"].label == "kept"
        assert torch.equal(out["sum"].a, 2 * a + b.sum(-1))
        assert torch.equal(out["flipped"][0], b.flip(-1))
        assert len(graphs) == 1
    a[0] = 100.0  # the caller's tensors stay theirs
    assert out["sum"].a[0] == 2 * 0 + b[0].sum()


def test_later_calls_run_the_first_calls_function_as_a_replay_would():
    """A replay runs what the capture recorded; the eager twin runs the first call's function
    again, so a function that baked in a value its key does not name is caught on the CPU."""
    graphs = PhaseGraphs(capture=False)
    inputs = {"a": torch.ones(2), "rest": (torch.ones(2, 3),)}
    for scale in (1.0, 5.0):  # the second function differs, under the same key

        def scaled(tree, scale=scale):
            return {"out": scale * tree["a"]}

        out = graphs.run("phase", scaled, inputs, 2)
        assert torch.equal(out["out"], torch.ones(2))  # the first function's result, twice


def test_another_key_or_shape_is_another_capture():
    graphs = PhaseGraphs(granule=4, capture=False)
    b = torch.ones(3, 2)
    graphs.run("one", phase, {"a": torch.ones(3), "rest": (b,)}, 3)
    graphs.run("two", phase, {"a": torch.ones(3), "rest": (b,)}, 3)
    graphs.run("one", phase, {"a": torch.ones(5), "rest": (torch.ones(5, 2),)}, 5)  # pads to 8
    graphs.run("one", phase, {"a": torch.ones(3), "rest": (torch.ones(3, 6),)}, 3)  # wider b
    graphs.run("one", phase, {"a": torch.ones(2), "rest": (torch.ones(2, 2),)}, 2)  # as first
    assert len(graphs) == 4


@pytest.mark.float_sensitive
@pytest.mark.parametrize(
    "estimator",
    [
        {"name": "cg"},
        {"name": "neumann"},
        {"name": "first_order"},
        # every coordinate of x, 64 per gradient: 2-3 minutes on a 2-core EPYC
        pytest.param({"name": "finite_difference", "coordinate_batch": 64}, marks=pytest.mark.slow),
    ],
    ids=lambda e: e["name"],
)
def test_rabo_through_the_phase_cache_agrees_with_the_batched_run(estimator: dict):
    """RABO's inner and outer phases through the cache (cohorts padded to multiples of 8,
    minibatches to the full batch) against the plain batched run, float64, 3 rounds of the
    demo fleet: the states to 1e-10 relative, as test_batched.py allows batched against
    sequential (the padded clients change the kernels' batch sizes, which changes summation
    orders: rounding of ~1e3 terms, ~1e-13), ledgers exactly. Every stacked cohort went
    through the cache, and later rounds ran the first round's phase functions (the twin's
    replay): nothing of a round is baked into them."""
    overrides = dict(rounds=3, runtime={"dtype": "float64"}, estimator=estimator)
    plain = build(small_config(**overrides))
    plain.simulation.backend = BatchedBackend()
    graphed = build(small_config(**overrides))
    graphed.simulation.backend = BatchedBackend()
    graphs = graphed.simulation.runtime.graphs = PhaseGraphs(capture=False)
    calls: list[tuple[str, int]] = []
    original = PhaseGraphs.run

    def spy(self, key, fn, inputs, clients):
        calls.append((key[0], clients))
        return original(self, key, fn, inputs, clients)

    sizes: list[tuple[str, int]] = []
    stack = Cohort.stack.__func__  # type: ignore[attr-defined]

    def spy_stack(cls, tasks, prepared):
        sizes.append(("rabo.inner" if "inner" in prepared[0].steps else "rabo.outer", len(tasks)))
        return stack(cls, tasks, prepared)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PhaseGraphs, "run", spy)
        patch.setattr(Cohort, "stack", classmethod(spy_stack))
        a = list(plain.simulation.iterate(plain.initial_state, 3))
        sizes.clear()
        b = list(graphed.simulation.iterate(graphed.initial_state, 3))
    assert calls == sizes and {"rabo.inner", "rabo.outer"} <= {name for name, _ in calls}
    assert 2 <= len(graphs) < len(calls)  # later rounds met captured shapes
    assert_runs_agree(a, b)


@pytest.mark.float_sensitive
def test_clients_with_unequal_step_counts_run_through_the_cache_masked():
    """Cohorts of clients whose step counts were drawn apart (1 to 4) run through the cache
    too: the largest count of steps, each client masked past its own by the counts on the
    device (an input of the phase, so one capture serves any counts of a shape), as the eager
    loop masks it. float64 states to 1e-10 of the plain batched run, ledgers exactly, every
    stacked inner cohort through the cache, mixed ones included."""
    fleet = {**demo_dict()["fleet"], "local_steps": "uniform", "local_steps_range": [1, 4]}
    overrides = dict(rounds=3, fleet=fleet, runtime={"dtype": "float64"})
    plain = build(small_config(**overrides))
    plain.simulation.backend = BatchedBackend()
    graphed = build(small_config(**overrides))
    graphed.simulation.backend = BatchedBackend()
    graphed.simulation.runtime.graphs = PhaseGraphs(capture=False)
    steps: list[list[int]] = []
    calls: list[int] = []
    stack = Cohort.stack.__func__  # type: ignore[attr-defined]
    original = PhaseGraphs.run

    def spy_stack(cls, tasks, prepared):
        cohort = stack(cls, tasks, prepared)
        if "inner" in prepared[0].steps:
            steps.append(cohort.num_steps)
        return cohort

    def spy(self, key, fn, inputs, clients):
        if key[0] == "rabo.inner":
            calls.append(clients)
        return original(self, key, fn, inputs, clients)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Cohort, "stack", classmethod(spy_stack))
        a = list(plain.simulation.iterate(plain.initial_state, 3))
        steps.clear()
        patch.setattr(PhaseGraphs, "run", spy)
        b = list(graphed.simulation.iterate(graphed.initial_state, 3))
    assert sum(len(set(s)) > 1 for s in steps) >= 3  # drawn apart
    assert calls == [len(s) for s in steps]
    assert_runs_agree(a, b)


UNEVEN_FLEET = {**demo_dict()["fleet"], "local_steps": "uniform", "local_steps_range": [1, 4]}
FEW_SHOT = {"name": "few_shot", "ways": 5, "shots": 2, "queries": 3, "test_episodes": 10}

# Local steps through the cache, by case: the phases that replay them (a pattern of the phase's
# name -> the key of its steps), and the config's overrides. FedAvg on the demo fleet
# (HeteroFL-like masks, some cohorts of one client, which run eagerly), and with clients of 1
# to 4 steps (budget steps, masked on the device); Dist-ProtoNet, FedAvg's steps with the
# prototypical loss on x alone (y passed as a fixed input), on few-shot episodes of a small
# Conv4 with BatchNorm; SimFBO with the exact products, ShroFBO with finite differences (whose
# check of a vanishing step is deferred) and in its fully first-order mode, on clients of 1
# to 4 steps; FedSVRBGD-FO with its STORM correction (6 gradients a step) and without
# (momentum 1: 3), its first round starting from Alg. 1's line 1 inside the phase; the lower
# level of AggITD and its backward sweep (the steps replayed, then v back-propagated through
# them from the last step down, each client from its own); FedNest's SVRG-corrected steps on y (with the server's q) and on x;
# LFedNest's plain ones on y (no q: another input structure); Dist-MAML's meta-steps, second
# order (double backward through the adaptation) and first order
TRAIN = "train"
#: the baselines that train the full model on every client
FULL_FLEET = {**demo_dict()["fleet"], "capacities": [1.0]}
FULL_UNEVEN = {**UNEVEN_FLEET, "capacities": [1.0]}
STEP_CASES: dict[str, tuple[dict[str, str], dict]] = {
    "fedavg": ({TRAIN: "fedavg.step"}, dict(algorithm={"name": "fedavg", "local_steps": 3})),
    "fedavg-uneven": (
        {TRAIN: "fedavg.step"},
        dict(algorithm={"name": "fedavg", "local_steps": 3}, fleet=UNEVEN_FLEET),
    ),
    "protonet-few_shot": (
        {TRAIN: "fedavg.step"},
        dict(
            algorithm={"name": "protonet", "local_steps": 2},
            model={"name": "conv4", "width": 4},
            task={**FEW_SHOT, "prototypes": True},
            partition={"alpha": 100.0},  # every client holds every class
            fleet={"num_clients": 4},
            mask={"policy": "none"},
        ),
    ),
    "simfbo-autograd": (
        {TRAIN: "simfbo.step"},
        dict(algorithm={"name": "simfbo", "local_steps": 3}, estimator={"name": "autograd"}),
    ),
    "shrofbo-finite_difference-uneven": (
        {TRAIN: "simfbo.step"},
        dict(
            algorithm={"name": "shrofbo"},
            estimator={"name": "finite_difference", "hvp_mu": 1e-4},
            fleet=UNEVEN_FLEET,
        ),
    ),
    "shrofbo-first_order-uneven": (
        {TRAIN: "simfbo.step"},
        dict(
            algorithm={"name": "shrofbo"},
            estimator={"name": "first_order", "lam": 10.0},
            fleet=UNEVEN_FLEET,
        ),
    ),
    "fedsvrbgd_fo-uneven": (
        {TRAIN: "fedsvrbgd.step"},
        dict(algorithm={"name": "fedsvrbgd_fo", "momentum": 0.5}, fleet=UNEVEN_FLEET),
    ),
    "fedsvrbgd_fo-momentum_1": (
        {TRAIN: "fedsvrbgd.step"},
        dict(
            algorithm={"name": "fedsvrbgd_fo", "local_steps": 3, "momentum": 1.0, "eta": 0.1},
            estimator={"name": "first_order", "lam": 5.0},
        ),
    ),
    "maml-few_shot": (
        {TRAIN: "maml.step"},
        dict(
            algorithm={"name": "maml", "local_steps": 2, "inner_steps": 2},
            model={"name": "conv4", "width": 4},
            task=FEW_SHOT,
            partition={"alpha": 100.0},
            fleet={"num_clients": 4},
            mask={"policy": "none"},
        ),
    ),
    "maml-first_order-few_shot-uneven": (
        {TRAIN: "maml.step"},
        dict(
            algorithm={"name": "maml", "inner_steps": 2, "first_order": True},
            model={"name": "conv4", "width": 4, "batchnorm": "static"},
            task=FEW_SHOT,
            partition={"alpha": 100.0},
            fleet={"num_clients": 4, "local_steps": "uniform", "local_steps_range": [1, 3]},
            mask={"policy": "none"},
        ),
    ),
    "aggitd-uneven": (
        {r"inner\.\d+": "aggitd.local", r"itd\.\d+": "aggitd.backward"},
        dict(
            algorithm={"name": "aggitd", "inner_rounds": 2},
            estimator={"name": "autograd"},
            fleet=FULL_UNEVEN,
            mask={"policy": "none"},
        ),
    ),
    "fednest": (
        {r"inner\.\d+\.local": "fednest.local_y", r"outer\.local": "fednest.local_x"},
        dict(
            algorithm={"name": "fednest", "local_steps": 2, "outer_local_steps": 2},
            estimator={"name": "autograd"},
            fleet=FULL_FLEET,
            mask={"policy": "none"},
        ),
    ),
    "lfednest-uneven": (
        {r"inner\.\d+": "fednest.local_y"},
        dict(
            algorithm={"name": "lfednest", "outer_local_steps": 2},
            estimator={"name": "autograd"},
            fleet=FULL_UNEVEN,
            mask={"policy": "none"},
        ),
    ),
}


def _replayed(phases: dict[str, str], phase: str) -> str | None:
    """The key of the steps a phase named ``phase`` replays (STEP_CASES), or None."""
    return next((key for pattern, key in phases.items() if re.fullmatch(pattern, phase)), None)


@pytest.mark.float_sensitive
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_local_steps_through_the_phase_cache_agree_with_the_batched_run(case: str):
    """The local steps of STEP_CASES (FedAvg, Dist-ProtoNet, SimFBO, ShroFBO, FedSVRBGD-FO,
    Dist-MAML, AggITD, FedNest, LFedNest) through the cache against the plain batched run, float64, 3
    rounds: the states to 1e-10 relative and ledgers exactly (work counts included), as for
    RABO above. Every stacked cohort of the phases that replay went through the cache, with
    each client's step count where they differ; later rounds ran the first round's phase
    functions (the twin's replay)."""
    phases, sections = STEP_CASES[case]
    overrides = dict(rounds=3, runtime={"dtype": "float64"}, **sections)
    plain = build(small_config(**overrides))
    plain.simulation.backend = BatchedBackend()
    graphed = build(small_config(**overrides))
    graphed.simulation.backend = BatchedBackend()
    graphs = graphed.simulation.runtime.graphs = PhaseGraphs(capture=False)
    calls: list[tuple[str, int, bool]] = []
    stacked: list[tuple[str, int, bool]] = []
    original = PhaseGraphs.run
    stack = Cohort.stack.__func__  # type: ignore[attr-defined]

    def spy(self, key, fn, inputs, clients):
        # the counts, where they differ: the last input (else the dict of minibatch blocks)
        calls.append((key[0], clients, isinstance(inputs[-1], torch.Tensor)))
        return original(self, key, fn, inputs, clients)

    def spy_stack(cls, tasks, prepared):
        cohort = stack(cls, tasks, prepared)
        key = _replayed(phases, tasks[0].phase)
        if cohort.stacked and key is not None and min(cohort.num_steps) >= 1:
            stacked.append((key, len(tasks), len(set(cohort.num_steps)) > 1))
        return cohort

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Cohort, "stack", classmethod(spy_stack))
        a = list(plain.simulation.iterate(plain.initial_state, 3))
        stacked.clear()
        patch.setattr(PhaseGraphs, "run", spy)
        b = list(graphed.simulation.iterate(graphed.initial_state, 3))
    assert calls == stacked and len(calls) >= 3
    assert any(uneven for *_, uneven in calls) == case.endswith("-uneven")
    assert 1 <= len(graphs) < len(calls)  # later rounds met captured shapes
    assert_runs_agree(a, b)


def test_a_cohorts_steps_run_eagerly_or_replayed_by_run_steps():
    """``Cohort.replays`` says whether ``run_steps`` replays: graphs, a stacked cohort, every
    client stepping. Without, ``run`` runs as it is given, on ``Cohort.step_data`` and each
    client's step count; with, on the steps' minibatches stacked for the cache, the largest
    count, and each client's work its count times one step's (a loop whose steps differ in
    work is refused with a sentence)."""
    from radbo.client import Prepared
    from radbo.loops import LocalSteps

    exp = build(small_config(rounds=1))
    runtime = exp.simulation.runtime
    task = _one_task(exp)
    steps = torch.tensor([[1, 2], [3, 4]])
    two = Cohort.stack([task, task], [Prepared(steps={"inner": steps}, num_steps=2)] * 2)
    one = Cohort.single(task, Prepared(steps={"inner": steps}, num_steps=2))
    idle = Cohort.stack([task, task], [Prepared(steps={"inner": steps[:0]}, num_steps=0)] * 2)
    seen = []

    def run(state, step_data, steps, counts, work=(6, 2)):
        seen.append((steps, counts))
        carry = {
            "first": step_data("inner", 0),
            "last": step_data("inner", 1) + state[0][:, None],
        }
        clients = state[0].shape[0]
        return LocalSteps(carry, [work[0]] * clients, [work[1]] * clients)

    state = (torch.tensor([10, 20]),)
    assert not two.replays(runtime)  # no graphs: run eagerly
    eager = two.run_steps(runtime, "k", state, [("inner", 2)], run)
    assert seen == [([2, 2], None)]
    assert eager.n_grad == [6, 6] and eager.n_hvp == [2, 2]
    runtime.graphs = PhaseGraphs(capture=False)
    assert two.replays(runtime) and not one.replays(runtime)
    assert not idle.replays(runtime)  # a client without steps
    seen.clear()
    out = two.run_steps(runtime, "k", state, [("inner", 2)], run)
    assert seen == [(2, None)]  # equal counts: none passed
    assert out.carry["first"].tolist() == [[1, 2], [1, 2]] == eager.carry["first"].tolist()
    assert out.carry["last"].tolist() == [[13, 14], [23, 24]] == eager.carry["last"].tolist()
    assert out.n_grad == [6, 6] and out.n_hvp == [2, 2]  # 3 and 1 a step, 2 steps each
    uneven = functools.partial(run, work=(5, 2))
    with pytest.raises(ValueError, match="is not the same in each of 2 steps"):
        two.run_steps(runtime, "k2", state, [("inner", 2)], uneven)


def test_a_cohorts_block_of_steps_repeats_a_short_clients_last_minibatch():
    """``Cohort.steps_block`` of clients with 2 and 3 steps: ``[3, clients, batch]``, the
    first client's step 2 its step 1 again (what ``step_data`` gives a client past its last
    step); a cohort of one unstacked client has no block."""
    from radbo.client import Prepared

    exp = build(small_config(rounds=1))
    task, _ = _one_task(exp)
    short = torch.tensor([[1, 2], [3, 4]])
    long = torch.tensor([[5, 6], [7, 8], [9, 10]])
    prepared = [
        Prepared(steps={"inner": t}, num_steps=len(t), ragged=frozenset({"inner"}))
        for t in (short, long)
    ]
    cohort = Cohort.stack([task, task], prepared)
    block = cohort.steps_block("inner")
    assert block.tolist() == [[[1, 2], [5, 6]], [[3, 4], [7, 8]], [[3, 4], [9, 10]]]
    assert all(torch.equal(block[t], cohort.step_data("inner", t)) for t in range(3))
    with pytest.raises(ValueError, match="stacked cohort of clients that step"):
        Cohort.single(*_one_task(exp)).steps_block("inner")


def _one_task(exp):
    from tests.simulation.test_batched import inner_tasks

    task = inner_tasks(exp, [0])[0]
    work = exp.simulation.algorithm.phases()[0].client
    return task, work.prepare(exp.simulation.runtime, task)


@pytest.mark.parametrize(
    "runtime",
    [
        {"cuda_graphs": True},
        {"cuda_graphs": True, "device": "cuda"},
        {"cuda_graphs": True, "backend": "batched"},
    ],
)
def test_cuda_graphs_need_a_gpu_and_the_batched_backend(runtime: dict):
    data = demo_dict()
    data["runtime"] = runtime
    with pytest.raises(ConfigError, match='cuda_graphs = true needs device = "cuda" and backend'):
        parse_config(data)


def test_cuda_graphs_are_off_by_default_and_left_out_of_dumps():
    config = parse_config(demo_dict())
    assert config.runtime.cuda_graphs is False
    assert "cuda_graphs" not in config.model_dump()["runtime"]
    exp = build(config)
    assert exp.simulation.runtime.graphs is None


def test_a_phase_that_cannot_be_captured_warns_once_and_runs_eagerly(monkeypatch):
    graphs = PhaseGraphs(granule=8)

    def refuse(self, fn, inputs):
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(PhaseGraphs, "_record", refuse)
    a, b = torch.arange(3.0), torch.ones(3, 2)
    with pytest.warns(RuntimeWarning, match=r"capturing phase 'phase' .* not permitted when"):
        out = graphs.run("phase", phase, {"a": a, "rest": (b,)}, 3)
    assert torch.equal(out["sum"].a, 2 * a + 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = graphs.run("phase", phase, {"a": a + 1, "rest": (b,)}, 3)
    assert torch.equal(again["sum"].a, 2 * a + 4) and len(graphs) == 0


def test_a_cohorts_cg_solve_inside_a_capture_runs_every_iteration_to_the_same_values(
    monkeypatch,
):
    """Inside a capture (forced here: a CPU has none) ``solve_cg`` reads nothing on the host:
    it runs all ``max_iter`` iterations with converged clients masked. Clients whose systems
    have 1, 2, 3 and 4 distinct eigenvalues converge after that many iterations; the eager
    solve stops once all have, the captured one goes on to 10: bitwise the same solutions
    and counts (the masked iterations compute only what ``torch.where`` then drops)."""
    import radbo.autodiff as autodiff

    gen = torch.Generator().manual_seed(0)
    eigen = [[2.0] * 4, [1.0, 3.0, 1.0, 3.0], [1.0, 2.0, 5.0, 5.0], [1.0, 2.0, 4.0, 8.0]]
    q = torch.linalg.qr(torch.randn(4, 4, 4, generator=gen, dtype=torch.float64))[0]
    a = q @ torch.diag_embed(torch.tensor(eigen, dtype=torch.float64)) @ q.transpose(1, 2)
    b = (torch.randn(4, 4, generator=gen, dtype=torch.float64),)
    products: list[int] = []

    def matvec(u):
        products.append(1)
        return ((a @ u[0].unsqueeze(-1)).squeeze(-1),)

    eager, eager_counts = autodiff.solve_cg(matvec, b, max_iter=10, tol=1e-24, lead=1)
    eager_products = len(products)
    monkeypatch.setattr(autodiff, "capturing_graph", lambda t: True)
    products.clear()
    graphed, graphed_counts = autodiff.solve_cg(matvec, b, max_iter=10, tol=1e-24, lead=1)
    assert eager_counts.tolist() == [1, 2, 3, 4] and eager_products == 4  # stopped early
    assert len(products) == 10
    assert torch.equal(graphed[0], eager[0]) and torch.equal(graphed_counts, eager_counts)
    expected = torch.linalg.solve(a, b[0].unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(eager[0], expected, rtol=1e-10, atol=1e-12)


# aten operations a captured phase must not issue. On a GPU each reads a device value on the
# host or sizes its output by the data (item, bool(t), nonzero, boolean indexing, unique, ...):
# a synchronisation, which a capture refuses; or draws random numbers, which a replay would
# draw afresh where the eager run drew once per round from the task's generator (the phases
# take their draws as inputs, made in prepare_inner / prepare_outer)
NOT_IN_A_CAPTURE = frozenset(
    {
        "_local_scalar_dense",
        "is_nonzero",
        "equal",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "repeat_interleave",
        "bincount",
        "randperm",
        "rand",
        "randn",
        "randint",
        "normal",
        "normal_",
        "uniform_",
        "random_",
        "bernoulli",
        "bernoulli_",
        "multinomial",
    }
)


# factories that make their tensor on the default device (the CPU) unless given one; the
# device is filled in before the aten operation, so they are watched as Python calls
MADE_ON_THE_DEFAULT_DEVICE = (
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.empty_strided,
    torch.full,
    torch.eye,
    torch.linspace,
    torch.logspace,
    torch.tensor,
    torch.scalar_tensor,
)


@pytest.mark.parametrize(
    "estimator",
    [
        {"name": "cg"},
        {"name": "neumann"},
        {"name": "first_order"},
        {"name": "finite_difference", "num_coordinates": 8, "coordinate_batch": 4},
        {"name": "cg", "uneven": True},  # clients of 1 to 4 steps: the inner steps masked
    ],
    ids=lambda e: e["name"] + ("-uneven" if e.get("uneven") else ""),
)
def test_rabos_captured_phases_read_nothing_on_the_host(estimator: dict):
    """Every aten operation of RABO's phases, as the cache runs them (forward and backward,
    every call, each estimator), is recorded; none of NOT_IN_A_CAPTURE may occur, nor a
    boolean index, a tensor made from Python data or a factory without a device (on a GPU
    run, a tensor on the CPU). This is what a CPU can check of a capture's rules: it finds a
    host read (``.item()``, ``bool(t)``, a boolean index) before a GPU session spends its
    minutes on a capture that fails."""
    estimator = dict(estimator)
    fleet = demo_dict()["fleet"]
    if estimator.pop("uneven", False):
        fleet.update(local_steps="uniform", local_steps_range=[1, 4])
    keys, ops, seen = _watch_phases(dict(fleet=fleet, estimator=estimator))
    assert keys == {"rabo.inner", "rabo.outer"}
    assert ops > 1000  # the phases ran inside the mode, backward passes included
    assert seen == {}


@pytest.mark.parametrize("case", list(STEP_CASES))
def test_captured_local_steps_read_nothing_on_the_host(case: str):
    """The same watch on the local steps of STEP_CASES."""
    phases, sections = STEP_CASES[case]
    keys, ops, seen = _watch_phases(sections)
    assert keys == set(phases.values())
    assert ops > 500  # the steps ran inside the mode, backward passes included
    assert seen == {}


def _watch_phases(overrides: dict) -> tuple[set[str], int, dict[str, int]]:
    """Two rounds of ``small_config(**overrides)`` in float64 on the batched backend through
    the cache: the keys of the phases it ran, the aten operations they issued and those of
    them a capture may not hold (by name, counted)."""
    from torch.overrides import TorchFunctionMode

    import radbo.autodiff as autodiff
    from radbo._torch_private import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: dict[str, int] = {}
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            name = func.overloadpacket.__name__
            if name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
            ):
                name = "boolean index"  # a nonzero on a GPU: its output sized by the data
            if name in ("lift_fresh", "lift_fresh_copy"):
                name = "tensor from Python data"  # a copy from the host inside the capture
            if name in NOT_IN_A_CAPTURE or " " in name:
                self.seen[name] = self.seen.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    class Factories(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in MADE_ON_THE_DEFAULT_DEVICE and kwargs.get("device") is None:
                watch.seen[f"torch.{func.__name__} without a device"] = 1
            return func(*args, **kwargs)

    watch = Watch()
    record, run = PhaseGraphs._record, PhaseGraphs.run
    keys: set[str] = set()
    inside = [False]  # in a phase the cache runs: as in a capture (forced: a CPU has none)

    def watched_record(self, fn, inputs):
        def watched(tree):
            inside[0] = True
            try:
                with watch, Factories():
                    return fn(tree)
            finally:
                inside[0] = False

        return record(self, watched, inputs)

    def spy(self, key, fn, inputs, clients):
        keys.add(key[0])
        return run(self, key, fn, inputs, clients)

    exp = build(small_config(rounds=2, runtime={"dtype": "float64"}, **overrides))
    exp.simulation.backend = BatchedBackend()
    exp.simulation.runtime.graphs = PhaseGraphs(capture=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PhaseGraphs, "_record", watched_record)
        patch.setattr(PhaseGraphs, "run", spy)
        patch.setattr(autodiff, "capturing_graph", lambda t: inside[0])
        list(exp.simulation.iterate(exp.initial_state, 2))
    return keys, watch.ops, watch.seen


def test_a_check_is_made_at_once_outside_and_after_the_phase_inside_the_cache():
    """radbo.graphs.check: outside a phase the cache runs, ``fail`` is called at once; inside,
    after the phase has returned (and on every later call, with that call's values: what a
    replay's deferred checks read)."""
    from radbo.graphs import check

    events: list[str] = []

    def fail(value: torch.Tensor) -> None:
        events.append(f"fail {value.tolist()}")
        raise ValueError(f"negative entry in {value.tolist()}")

    def guarded(inputs):
        a = inputs["a"] * 2
        check((a < 0).any(), lambda: fail(a))
        events.append("phase done")
        return {"a": a}

    check(torch.tensor(False), lambda: fail(torch.zeros(1)))  # at once, holds: nothing
    with pytest.raises(ValueError, match=r"negative entry in \[-2.0\]"):
        check(torch.tensor(True), lambda: fail(torch.tensor([-1.0]) * 2))
    events.clear()

    graphs = PhaseGraphs(capture=False)
    out = graphs.run("g", guarded, {"a": torch.tensor([1.0, 2.0, 3.0])}, clients=3)
    assert out["a"].tolist() == [2.0, 4.0, 6.0] and events == ["phase done"]
    events.clear()
    with pytest.raises(ValueError, match=r"negative entry in \[2.0, -4.0, 6.0"):
        graphs.run("g", guarded, {"a": torch.tensor([1.0, -2.0, 3.0])}, clients=3)
    assert events[0] == "phase done"  # the phase ran to its end; the check came after
    assert len(graphs) == 1


def test_a_vanishing_finite_difference_step_is_the_same_error_through_the_cache():
    """RABO with finite differences whose ``mu`` vanishes next to x: the plain batched run
    raises the one-line error inside the phase, the cache after it (inside a capture no value
    may be read), naming the same coordinate."""
    overrides = dict(
        rounds=1,
        runtime={"dtype": "float64"},
        estimator={"name": "finite_difference", "num_coordinates": 4, "mu": 1e-300},
    )
    import radbo.graphs as graphs_module

    deferred: list[int] = []
    run_checks = graphs_module._run_checks

    def spy(checks):
        deferred.append(len(checks))
        return run_checks(checks)

    errors = []
    for graphs in (None, PhaseGraphs(capture=False)):
        exp = build(small_config(**overrides))
        exp.simulation.backend = BatchedBackend()
        exp.simulation.runtime.graphs = graphs
        with pytest.raises(ValueError, match="vanishes next to") as err:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(graphs_module, "_run_checks", spy)
                list(exp.simulation.iterate(exp.initial_state, 1))
        errors.append(str(err.value))
    assert errors[0] == errors[1] and "\n" not in errors[0]
    assert deferred and deferred[-1] > 0  # the cache's phase deferred the checks it raised
