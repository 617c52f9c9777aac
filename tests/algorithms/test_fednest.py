"""FedNest and LFedNest (Tarzanagh et al., ICML 2022, arXiv:2205.02215) on the engine: one outer
iteration of each recomputed by hand in float64, the communication rounds of Table 2,
failures, batched == sequential, and the digits hyper-representation run.

Tolerances: the hand computations run the same float64 arithmetic in another order (the
engine draws full batches as permutations and averages in float64 through the aggregation), so
states agree to rounding: a few hundred float64 operations on values of size <= 0.6 round at
about 1e-16 each (gamma_k * scale ~ 1e-14 for k ~ 100), and the differences measured are at most
1.1e-16 absolute on the default, AVX2 and AVX-512 kernels; the bound, 1e-10 relative plus
1e-10 absolute, is six orders above that and would still catch a missing or extra term."""

import pytest
import torch

from radbo.algorithms.fednest import FedNest, LFedNest
from radbo.client import ClientBudget
from radbo.config import parse_config
from radbo.experiment import run
from radbo.problem import Batch
from radbo.randomness import Stream, derive_seed
from radbo.simulation import BatchedBackend, SequentialBackend
from tests.helpers import TOY_TASK as TASK
from tests.helpers import Recorder, leaf, nan_where, toy_clients, toy_mlp, toy_simulation

# float64 rounding of reordered sums over a few steps: measured <= 1.1e-16 absolute on values of
# size <= 0.6 (default/avx2/avx512), bound 1e-10 (see the module docstring)
RTOL = 1e-10
NUM_CLIENTS = 4


def setup(cls=FedNest, *, steps=(2, 2, 2, 2), seed=0, backend=None, **kw):
    """Four clients of the toy 5-4-3 MLP problem with their own 12 inner + 8 outer examples
    (so local objectives differ and the SVRG corrections matter); batches hold all of a
    client's examples, so every gradient and product is deterministic and the iteration can
    be recomputed by hand."""
    toy = toy_mlp(20 * NUM_CLIENTS)
    settings = {
        "inner_lr": 0.4,
        "outer_lr": 0.3,
        "inner_steps": 2,
        "outer_local_steps": 2,
        "batch_size": 100,
        "outer_batch_size": 100,
        "neumann_terms": 4,
        "eta": 0.5,
        "clients_per_phase": 2,
        **kw,
    }
    algo = cls(outer_names=tuple(toy.x), inner_names=tuple(toy.y), seed=seed, **settings)
    sim = toy_simulation(
        algo,
        toy,
        toy_clients(NUM_CLIENTS),
        budgets=[ClientBudget(local_steps=s) for s in steps],
        seed=seed,
        backend=backend or SequentialBackend(),
    )
    return sim, algo, toy.model, toy.x, toy.y


class ByHand:
    """Plain-autograd derivatives of client c's losses (independent of radbo.autodiff)."""

    def __init__(self, sim, model):
        self.sim, self.model = sim, model

    def batches(self, c):
        data, f, lab = self.sim.clients[c], self.sim.runtime.features, self.sim.runtime.labels
        return Batch(f[data.inner], lab[data.inner]), Batch(f[data.outer], lab[data.outer])

    def g(self, c, x, y):
        return TASK.inner_loss(self.model, x, y, {}, self.batches(c)[0])

    def f(self, c, x, y):
        return TASK.outer_loss(self.model, x, y, {}, self.batches(c)[1])

    def grad(self, loss, c, x, y, wrt):
        xl, yl = leaf(x), leaf(y)
        target = xl if wrt == "x" else yl
        grads = torch.autograd.grad(loss(c, xl, yl), list(target.values()))
        return dict(zip(target, grads, strict=True))

    def products(self, c, x, y, p):
        """(∇²_yy g_c p, ∇²_xy g_c p)."""
        xl, yl = leaf(x), leaf(y)
        gy = torch.autograd.grad(self.g(c, xl, yl), list(yl.values()), create_graph=True)
        pv = [p[k] for k in yl]
        hp = torch.autograd.grad(gy, list(yl.values()), grad_outputs=pv, retain_graph=True)
        jp = torch.autograd.grad(gy, list(xl.values()), grad_outputs=pv)
        return dict(zip(yl, hp, strict=True)), dict(zip(xl, jp, strict=True))


def lin(*terms):
    """sum_j a_j d_j over dicts of tensors: lin((a, d), (b, e), ...)."""
    keys = terms[0][1].keys()
    return {k: sum(a * d[k] for a, d in terms) for k in keys}


def mean(dicts):
    return {k: torch.stack([d[k] for d in dicts]).mean(0) for k in dicts[0]}


def participants(record, arrived=False):
    """Which clients took part in each phase, from the ledger (with ``arrived``, only those
    whose reply arrived: a client that drops out is charged but uploads nothing)."""
    out: dict[str, list[int]] = {}
    for e in record.ledger:
        if e.bytes_up > 0 or not arrived:
            out.setdefault(e.phase, []).append(e.client)
    return out


def assert_close(got, want):
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=RTOL)


# ---------------------------------------------------------------------------------- FedNest
def clipped(h, radius):
    """h scaled down to norm ``radius`` when longer (None: unchanged)."""
    norm = float(sum((t**2).sum() for t in h.values()) ** 0.5)
    return h if radius is None or norm <= radius else lin((radius / norm, h))


def fednest_by_hand(sim, algo, model, x, y, who, terms):
    """Alg. 1 with FedInn (Alg. 4), FedIHGP (Alg. 3) and FedOut (Alg. 2), full batches, with
    the participants the engine sampled (``who``) and the truncation N' it drew (``terms``)."""
    d = ByHand(sim, model)
    beta, alpha, eta, n_terms = algo.inner_lr, algo.outer_lr, algo.eta, algo.neumann_terms
    for t in range(algo.inner_steps):
        q = mean([d.grad(d.g, c, x, y, "y") for c in who[f"inner.{t}.anchor"]])
        finals = []
        for c in who[f"inner.{t}.local"]:
            yi = y
            for _ in range(sim.budgets[c].local_steps):
                step = lin((1, d.grad(d.g, c, x, yi, "y")), (-1, d.grad(d.g, c, x, y, "y")), (1, q))
                yi = lin((1, yi), (-beta, step))
            finals.append(yi)
        y = mean(finals)
    p = lin((n_terms * eta, mean([d.grad(d.f, c, x, y, "y") for c in who["ihgp.0"]])))
    for n in range(1, terms + 1):
        p = mean([lin((1, p), (-eta, d.products(c, x, y, p)[0])) for c in who[f"ihgp.{n}"]])
    h = mean(
        [
            lin((1, d.grad(d.f, c, x, y, "x")), (-1, d.products(c, x, y, p)[1]))
            for c in who["outer.hypergrad"]
        ]
    )
    h = clipped(h, algo.max_hypergrad_norm)
    finals = []
    for c in who["outer.local"]:
        xi = x
        for _ in range(algo.outer_local_steps):
            step = lin((1, d.grad(d.f, c, xi, y, "x")), (-1, d.grad(d.f, c, x, y, "x")), (1, h))
            xi = lin((1, xi), (-alpha, step))
        finals.append(xi)
    return mean(finals), y


def drawn_terms(algo, round_=0):
    gen = torch.Generator().manual_seed(derive_seed(algo.seed, round_, Stream.NEUMANN_TERMS))
    return int(torch.randint(0, algo.neumann_terms, (), generator=gen, dtype=torch.int64))


def test_one_fednest_iteration_matches_algorithms_1_to_4_by_hand():
    # seed 2 draws N' = 3 (checked below): all three Neumann rounds run
    sim, algo, model, x, y = setup(seed=2)
    state, record = sim.step(algo.init(x, y, {}), 0)

    terms = drawn_terms(algo)
    assert terms == 3
    who = participants(record)
    want_x, want_y = fednest_by_hand(sim, algo, model, x, y, who, terms)
    assert_close(state.y, want_y)
    assert_close(state.x, want_x)
    assert state.carry == {} and state.round == 1
    assert record.metrics["neumann_terms"] == float(terms)


def test_fednest_rounds_sample_afresh_and_count_2t_plus_n_prime_plus_3():
    sim, algo, model, x, y = setup(seed=2)
    _, record = sim.step(algo.init(x, y, {}), 0)
    terms = drawn_terms(algo)
    who = participants(record)
    expected = [
        *(f"inner.{t}.{part}" for t in range(algo.inner_steps) for part in ("anchor", "local")),
        *(f"ihgp.{n}" for n in range(terms + 1)),
        "outer.hypergrad",
        "outer.local",
    ]
    assert list(who) == expected  # phases in order, the Neumann rounds past N' skipped
    assert record.communication_rounds == 2 * algo.inner_steps + terms + 3
    assert all(len(c) == 2 and len(set(c)) == 2 for c in who.values())  # 2 of 4 per round
    assert len({tuple(sorted(c)) for c in who.values()}) > 1  # each round draws its own
    # work counted where it happens: products only in the IHGP and the hypergradient
    for e in record.ledger:
        if e.phase.startswith("inner."):
            per_step = 2 if e.phase.endswith("local") else 1  # SVRG: two gradients a step
            steps = sim.budgets[e.client].local_steps if e.phase.endswith("local") else 1
            assert (e.n_grad, e.n_hvp) == (per_step * steps, 0)
        elif e.phase == "ihgp.0":
            assert (e.n_grad, e.n_hvp) == (1, 0)
        elif e.phase.startswith("ihgp.") or e.phase == "outer.hypergrad":
            assert (e.n_hvp, e.n_grad) == (1, 1 + (e.phase == "outer.hypergrad"))
        else:
            assert (e.n_grad, e.n_hvp) == (2 * algo.outer_local_steps, 0)


@pytest.mark.parametrize("seed", range(6))
def test_fednest_communication_rounds_for_every_truncation(seed):
    sim, algo, model, x, y = setup(seed=seed, inner_steps=1, neumann_terms=3)
    _, record = sim.step(algo.init(x, y, {}), 0)
    terms = drawn_terms(algo)
    assert record.communication_rounds == 2 * algo.inner_steps + terms + 3
    assert record.communication_rounds <= 2 * algo.inner_steps + algo.neumann_terms + 2


# --------------------------------------------------------------------------------- LFedNest
def lfednest_by_hand(sim, algo, model, x, y, who):
    """LFedInn (Alg. 6) T times, then LFedOut (Alg. 5) with each client's local IHGP; the
    truncations N'_{i,ν} are the client's first draws of its task generator."""
    d = ByHand(sim, model)
    beta, alpha, eta, n_terms = algo.inner_lr, algo.outer_lr, algo.eta, algo.neumann_terms
    for t in range(algo.inner_steps):
        finals = []
        for c in who[f"inner.{t}"]:
            yi = y
            for _ in range(sim.budgets[c].local_steps):
                yi = lin((1, yi), (-beta, d.grad(d.g, c, x, yi, "y")))
            finals.append(yi)
        y = mean(finals)
    finals, all_terms = [], []
    phase = algo.inner_steps  # "outer" is the phase after the T inner ones
    for c in who["outer"]:
        gen = torch.Generator().manual_seed(derive_seed(sim.seed, 0, phase + 1, c))
        terms = torch.randint(0, n_terms, (algo.outer_local_steps,), generator=gen).tolist()
        all_terms += terms
        xi = x
        for n_prime in terms:
            p = lin((n_terms * eta, d.grad(d.f, c, xi, y, "y")))
            for _ in range(n_prime):
                p = lin((1, p), (-eta, d.products(c, xi, y, p)[0]))
            h = lin((1, d.grad(d.f, c, xi, y, "x")), (-1, d.products(c, xi, y, p)[1]))
            h = clipped(h, algo.max_hypergrad_norm)
            xi = lin((1, xi), (-alpha, h))
        finals.append(xi)
    return mean(finals), y, all_terms


def test_one_lfednest_iteration_matches_algorithms_5_and_6_by_hand():
    sim, algo, model, x, y = setup(LFedNest, steps=(2, 3, 1, 2), outer_local_steps=3)
    state, record = sim.step(algo.init(x, y, {}), 0)

    who = participants(record)
    want_x, want_y, terms = lfednest_by_hand(sim, algo, model, x, y, who)
    assert sum(terms) > 0 and len(set(terms)) > 1  # local chains of different lengths ran
    assert_close(state.y, want_y)
    assert_close(state.x, want_x)
    assert state.round == 1
    # Table 2: T + 1 rounds, 2 of the 4 clients in each
    assert list(who) == [*(f"inner.{t}" for t in range(algo.inner_steps)), "outer"]
    assert record.communication_rounds == algo.inner_steps + 1
    assert all(len(c) == 2 for c in who.values())
    # each client's own N' products plus one mixed product per local step
    hvp = {e.client: e.n_hvp for e in record.ledger if e.phase == "outer"}
    per_client = [sum(terms[i : i + 3]) + 3 for i in range(0, len(terms), 3)]
    assert [hvp[c] for c in who["outer"]] == per_client


@pytest.mark.parametrize("cls", [FedNest, LFedNest])
def test_max_hypergrad_norm_clips_the_global_or_the_local_hypergradients(cls):
    sim, algo, model, x, y = setup(cls, seed=2, max_hypergrad_norm=0.01)
    state, record = sim.step(algo.init(x, y, {}), 0)
    who = participants(record)
    if cls is FedNest:
        # the clipping bites: measured 0.315 on every kernel, 31x the radius
        assert record.metrics["hypergrad_norm"] > 0.01
        want_x, _ = fednest_by_hand(sim, algo, model, x, y, who, drawn_terms(algo))
    else:
        want_x, _, _ = lfednest_by_hand(sim, algo, model, x, y, who)
    assert_close(state.x, want_x)
    if cls is LFedNest:  # every local step moves x by at most alpha * 0.01
        # float64: the clipped norm is 0.01 up to a few roundings (~1e-15 relative), so the
        # triangle inequality holds with the 1e-12 slack; measured 26% under the bound
        step = sum(float(((state.x[k] - x[k]) ** 2).sum()) for k in x) ** 0.5
        assert step <= algo.outer_lr * algo.outer_local_steps * 0.01 * (1 + 1e-12)


# --------------------------------------------------------------------- failures, backends
def spoil(phases):
    """Answers with NaN in the phases named ``phases``."""
    return Recorder(nan_where(lambda task: task.phase in phases))


def test_a_lost_neumann_round_ends_the_chain_and_the_hypergradient_goes_on():
    sim, algo, model, x, y = setup(seed=2)  # N' = 3
    sim.backend = spoil({"ihgp.2"})
    state, record = sim.step(algo.init(x, y, {}), 0)
    who = participants(record)

    assert record.metrics["ihgp_chain_cut"] == 2.0
    assert "ihgp.3" not in who and "outer.local" in who  # the chain stopped after 1 product
    assert record.communication_rounds == 2 * algo.inner_steps + 2 + 3
    assert record.rejected == {"ihgp.2": who["ihgp.2"]}
    want_x, want_y = fednest_by_hand(sim, algo, model, x, y, who, terms=1)
    assert_close(state.x, want_x)
    assert_close(state.y, want_y)


def test_lost_aggregates_skip_the_rounds_that_need_them():
    sim, algo, model, x, y = setup(seed=2)
    sim.backend = spoil({"inner.0.anchor", "ihgp.0"})
    state, record = sim.step(algo.init(x, y, {}), 0)
    who = participants(record)

    # no q: the first FedInn call makes no local step; no p: no hypergradient, x stays
    assert "inner.0.local" not in who and "inner.1.local" in who
    assert list(who)[-1] == "ihgp.0"
    assert record.communication_rounds == 2 * algo.inner_steps - 1 + 1
    assert all(torch.equal(state.x[k], x[k]) for k in x)
    assert state.carry == {} and state.round == 1
    assert all(bool(torch.isfinite(t).all()) for t in state.y.values())


@pytest.mark.parametrize(("cls", "seed"), [(FedNest, 3), (FedNest, 5), (LFedNest, 3)])
def test_a_client_that_drops_out_is_left_out_of_its_round_and_the_rest(cls, seed):
    """Client 3 always drops out, in a phase drawn by the engine (seed 3: FedNest's
    hypergradient round, LFedNest's outer round; seed 5: FedNest's local x round): its reply
    never arrives, the others' means go on without it."""
    sim, algo, model, x, y = setup(cls, seed=seed, clients_per_phase=None)
    sim.dropout = [0.0, 0.0, 0.0, 1.0]
    state, record = sim.step(algo.init(x, y, {}), 0)

    (phase,) = record.dropped
    assert record.dropped[phase] == [3] and phase.startswith("outer")
    who = participants(record, arrived=True)
    assert 3 not in who[phase]
    if cls is FedNest:
        want_x, want_y = fednest_by_hand(sim, algo, model, x, y, who, drawn_terms(algo))
    else:
        want_x, want_y, _ = lfednest_by_hand(sim, algo, model, x, y, who)
    assert_close(state.x, want_x)
    assert_close(state.y, want_y)
    assert state.carry == {} and state.round == 1


@pytest.mark.float_sensitive
@pytest.mark.parametrize("cls", [FedNest, LFedNest])
def test_batched_equals_sequential_with_heterogeneous_local_steps(cls):
    """Clients with 1..3 local steps and (LFedNest) local chains of different lengths run
    stacked: the batched run equals the sequential one, per-client work counts included.

    Two code paths (stacked vs per-client kernels) sum in different orders: float64 rounding of
    two iterations (~100s of operations on values <= 0.5, gamma_k * scale ~ 1e-14) bounds their
    difference; measured <= 5.6e-17 absolute on default/avx2/avx512. The bound, 1e-14 + 1e-12
    relative, is 180x that and stays above the derivation."""
    kw = {"steps": (1, 3, 2, 3), "seed": 2, "clients_per_phase": None, "outer_local_steps": 3}
    seq, algo, _, x, y = setup(cls, **kw)
    bat, _, _, _, _ = setup(cls, backend=BatchedBackend(), **kw)
    state_a, state_b = algo.init(x, y, {}), algo.init(x, y, {})
    for round_ in range(2):
        state_a, rec_a = seq.step(state_a, round_)
        state_b, rec_b = bat.step(state_b, round_)
        assert rec_a.ledger == rec_b.ledger
    for k in x:
        torch.testing.assert_close(state_b.x[k], state_a.x[k], rtol=1e-12, atol=1e-14)
    for k in y:
        torch.testing.assert_close(state_b.y[k], state_a.y[k], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------ config, API
def test_config_builds_fednest_and_lfednest():
    base = {
        "model": {"name": "mlp", "hidden": [8]},
        "fleet": {"num_clients": 3, "capacities": [1.0]},
        "mask": {"policy": "none"},
    }
    for name, cls in (("fednest", FedNest), ("lfednest", LFedNest)):
        cfg = parse_config({**base, "algorithm": {"name": name, "neumann_terms": 2}})
        from radbo.experiment import build

        algo = build(cfg).simulation.algorithm
        assert type(algo) is cls and algo.neumann_terms == 2
        assert algo.accepted_estimators() == ("autograd", "finite_difference")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"eta": 0.0}, "eta\n  Input should be greater than 0"),
        ({"neumann_terms": 0}, "neumann_terms\n  Input should be greater than or equal to 1"),
        ({"outer_local_steps": 0}, "outer_local_steps\n  Input should be greater than or equal"),
        ({"clients_per_phase": 0}, "clients_per_phase\n  Input should be greater than or equal"),
        ({"inner_lr": float("nan")}, "inner_lr\n  Input should be a finite number"),
    ],
)
def test_bad_hyperparameters(kw, message):
    with pytest.raises(ValueError, match=message):
        FedNest(outer_names=("a",), inner_names=("b",), **kw)


# ------------------------------------------------------------------------------ digits run
def digits_config(name, seed):
    """The demo's data and model (digits, hyper-representation MLP with 128 hidden units), iid
    over 10 clients, 5 sampled per communication round; float64 so that another CPU's rounding
    barely moves the numbers (the float32 initial draw still differs by an ulp between kernels:
    see the measurements below)."""
    return parse_config(
        {
            "seed": seed,
            "rounds": 25,
            "eval_every": 25,
            "data": {"name": "digits", "test_fraction": 0.2, "outer_fraction": 0.3},
            "partition": {"kind": "iid"},
            "model": {"name": "mlp", "hidden": [128]},
            "task": {"name": "hyper_representation", "inner_l2": 0.01},
            "fleet": {"num_clients": 10, "capacities": [1.0]},
            "mask": {"policy": "none"},
            "runtime": {"dtype": "float64", "backend": "batched"},
            "algorithm": {
                "name": name,
                "inner_lr": 0.5,
                "outer_lr": 0.3,
                "inner_steps": 1,
                "local_steps": 5,
                "outer_local_steps": 5,
                "neumann_terms": 5,
                "eta": 0.1,
                "clients_per_phase": 5,
            },
        }
    )


@pytest.mark.float_sensitive
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fednest_reaches_90_percent_on_digits_in_25_iterations(seed):
    """Measured (25 iterations, float64): test accuracy 0.925 / 0.942 / 0.947 for seeds 0 / 1 /
    2 (seeds 3-6: 0.955 / 0.922 / 0.928 / 0.925); LFedNest with the same settings 0.933 /
    0.939 / 0.955. The public FedNest code reaches 0.90 on MNIST within 25 iterations.
    Seeds 0 / 1 / 2 give 0.9248 / 0.9415 / 0.9471 on the default, AVX2 and AVX-512 kernels
    alike (float64: the kernels move only the float32 initial draw, by an ulp)."""
    result = run(digits_config("fednest", seed), progress=False, save=False)
    assert result.final["test_accuracy"] >= 0.90
    # 2T + N' + 3 rounds per iteration, N' < N
    rounds = [r["communication_rounds"] for r in result.rounds]
    assert all(5 <= n <= 2 + 5 + 2 for n in rounds) and len(set(rounds)) > 1
