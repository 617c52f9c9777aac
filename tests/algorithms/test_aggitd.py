"""FBO-AggITD (Xiao and Ji, ICML 2023, arXiv:2302.04969) on the engine: an iteration recomputed
by hand, the ITD hypergradient against autograd through the unrolled lower level, the rounds it
costs, failures, and a digits run.

Everything is float64. The hand computations use plain torch autograd (not radbo.autodiff) and
full batches, so radbo and the reference differ only by the rounding of different summation
orders: measured at most 1.0e-16 absolute on values of size <= 0.43 on the default, AVX2 and
AVX-512 kernels (a few hundred roundings bound it by gamma_k * scale ~ 1e-14); the tolerances
(1e-10 relative, 1e-12 absolute) leave four orders of magnitude to spare and would catch any
missing or extra term. (The model is initialised in float32 and cast, and torch's float32
``uniform_`` differs by an ulp between kernels, so the states themselves differ between kernels
by ~3e-8; both sides of every comparison start from the same draw.)
"""

import pytest
import torch
from torch.func import grad as func_grad

from radbo.algorithms.aggitd import AggITD
from radbo.config import ConfigError, parse_config
from radbo.experiment import run
from radbo.problem import Batch
from radbo.simulation import SequentialBackend
from tests.helpers import TOY_TASK as TASK
from tests.helpers import Recorder, leaf, nan_where, toy_clients, toy_mlp, toy_simulation
from tests.untrained import untrained_metrics

RTOL, ATOL = 1e-10, 1e-12


def setup(num_clients=3, *, same_data=False, **kw):
    """The toy 5-4-3 MLP (x = hidden layer, y = head). Client c holds examples 20c..20c+11
    (inner) and 20c+12..20c+19 (outer) -- different data per client unless ``same_data`` --
    and batches of 100 hold all of them, so every gradient and product is deterministic."""
    toy = toy_mlp(20 * num_clients)
    settings = {
        "inner_lr": 0.5,
        "outer_lr": 0.3,
        "inner_rounds": 2,
        "local_steps": 2,
        "batch_size": 100,
        "outer_batch_size": 100,
        **kw,
    }
    algo = AggITD(outer_names=tuple(toy.x), inner_names=tuple(toy.y), **settings)
    clients = toy_clients(num_clients, same_data=same_data)
    sim = toy_simulation(algo, toy, clients)
    features, labels = toy.features, toy.labels
    batches = [
        (
            Batch(features[d.inner], labels[d.inner]),
            Batch(features[d.outer], labels[d.outer]),
        )
        for d in clients
    ]
    return sim, algo, toy.model, toy.x, toy.y, batches


def mean(dicts):
    return {k: sum(d[k] for d in dicts) / len(dicts) for k in dicts[0]}


def assert_close(got, want):
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL)


class Reference:
    """The algorithm of the module docstring, by plain autograd with explicit double backward."""

    def __init__(self, algo, model, batches):
        self.algo, self.model, self.batches = algo, model, batches

    def g(self, c, x, y):
        return TASK.inner_loss(self.model, x, y, {}, self.batches[c][0])

    def f(self, c, x, y):
        return TASK.outer_loss(self.model, x, y, {}, self.batches[c][1])

    def local_iterates(self, c, x, y):
        """y_c^{r,0..tau} from y by tau gradient steps on g_c."""
        out = [y]
        for _ in range(self.algo.local_steps):
            yl = leaf(out[-1])
            grads = torch.autograd.grad(self.g(c, x, yl), list(yl.values()))
            out.append(
                {k: t - self.algo.inner_lr * d for (k, t), d in zip(yl.items(), grads, strict=True)}
            )
            out[-1] = {k: t.detach() for k, t in out[-1].items()}
        return out

    def local_vjp(self, c, x, y, v):
        """(d_x Y_c^T v, d_y Y_c^T v) through the client's tau local steps."""
        beta = self.algo.inner_lr
        iterates = self.local_iterates(c, x, y)[:-1]
        a = {k: torch.zeros_like(t) for k, t in x.items()}
        u = dict(v)
        for point in reversed(iterates):
            xl, yl = leaf(x), leaf(point)
            gy = torch.autograd.grad(self.g(c, xl, yl), list(yl.values()), create_graph=True)
            hu = torch.autograd.grad(gy, list(yl.values()), list(u.values()), retain_graph=True)
            ju = torch.autograd.grad(gy, list(xl.values()), list(u.values()))
            a = {k: a[k] - beta * j for k, j in zip(a, ju, strict=True)}
            u = {k: u[k] - beta * h for k, h in zip(u, hu, strict=True)}
        return a, u

    def outer_grads(self, c, x, y):
        xl, yl = leaf(x), leaf(y)
        grads = torch.autograd.grad(self.f(c, xl, yl), list(xl.values()) + list(yl.values()))
        return dict(zip(x, grads[: len(x)], strict=True)), dict(
            zip(y, grads[len(x) :], strict=True)
        )


def participants(record, phase):
    return [e.client for e in record.ledger if e.phase == phase]


# ------------------------------------------------------------------------------- (a) by hand
def test_one_iteration_matches_the_hand_computation():
    """3 clients with different data, 2 of them sampled afresh for every communication round;
    R = 2 lower-level rounds of tau = 2 local steps, then the outer round and the backward
    sweep itd.1, itd.0 -- each round recomputed with the clients the ledger says took part."""
    sim, algo, model, x, y, batches = setup(clients_per_phase=2)
    ref = Reference(algo, model, batches)

    state, record = sim.step(algo.init(x, y, {}), 0)

    ys = [y]
    for r in range(algo.inner_rounds):  # FedAvg on y: the mean of the last local iterates
        clients = participants(record, f"inner.{r}")
        ys.append(mean([ref.local_iterates(c, x, ys[-1])[-1] for c in clients]))
    clients = participants(record, "itd.outer")
    grads = [ref.outer_grads(c, x, ys[-1]) for c in clients]
    h = mean([gx for gx, _ in grads])
    v = mean([gy for _, gy in grads])
    for r in reversed(range(algo.inner_rounds)):  # back through the aggregated iterates
        vjps = [ref.local_vjp(c, x, ys[r], v) for c in participants(record, f"itd.{r}")]
        h = {k: h[k] + t for k, t in mean([a for a, _ in vjps]).items()}
        v = mean([u for _, u in vjps])
    want_x = {k: x[k] - algo.outer_lr * h[k] for k in x}

    assert_close(state.y, ys[-1])
    assert_close(state.x, want_x)
    assert record.communication_rounds == 2 * algo.inner_rounds + 1
    order = ["inner.0", "inner.1", "itd.outer", "itd.1", "itd.0"]
    assert list(dict.fromkeys(e.phase for e in record.ledger)) == order
    assert all(len(participants(record, p)) == 2 for p in order)
    assert len({tuple(participants(record, p)) for p in order}) > 1  # sampled afresh
    assert record.metrics["itd_complete"] == 1.0
    assert record.metrics["hypergrad_norm"] == pytest.approx(
        sum(float(t.norm() ** 2) for t in h.values()) ** 0.5, rel=RTOL
    )
    # work is counted where it happens: a gradient per local step forward, a gradient and one
    # joint product per replayed step backward, one gradient for the outer round
    for e in record.ledger:
        kind = e.phase.split(".")[0] if e.phase != "itd.outer" else "outer"
        assert (e.n_grad, e.n_hvp) == {"inner": (2, 0), "itd": (2, 2), "outer": (1, 0)}[kind]
    assert state.round == 1 and not bool(state.tape["alive"])


# ------------------------------------------------------------------- (b) against autograd
def unrolled_hypergradient(ref, clients, x, y, rounds, steps):
    """d/dx of mean_i f_i(x, y^R(x)), y^{r+1} = mean_i Y_i(x, y^r), Y_i = ``steps`` gradient
    steps on g_i -- torch.func through the whole unrolled federated lower level."""
    beta = ref.algo.inner_lr

    def outer(x_):
        y_ = dict(y)
        for _ in range(rounds):
            locals_ = []
            for c in clients:
                yc = y_
                for _ in range(steps):
                    g = func_grad(lambda yy, c=c: ref.g(c, x_, yy))(yc)
                    yc = {k: yc[k] - beta * g[k] for k in yc}
                locals_.append(yc)
            y_ = mean(locals_)
        return sum(ref.f(c, x_, y_) for c in clients) / len(clients)

    return func_grad(outer)(dict(x))


def hypergradient(algo, x, state):
    return {k: (x[k] - state.x[k]) / algo.outer_lr for k in x}


def test_one_client_itd_equals_autograd_through_the_unrolled_inner_steps():
    """One client, full batches: the hypergradient is exactly d/dx f(x, y_T(x)) with
    T = R tau = 6 gradient steps unrolled by torch.func."""
    sim, algo, model, x, y, batches = setup(num_clients=1, inner_rounds=2, local_steps=3)
    ref = Reference(algo, model, batches)

    state, record = sim.step(algo.init(x, y, {}), 0)

    want = unrolled_hypergradient(ref, [0], x, y, rounds=2, steps=3)
    assert_close(hypergradient(algo, x, state), want)
    assert record.communication_rounds == 5


def test_aggregated_itd_differentiates_the_federated_trajectory_not_the_local_ones():
    """Three clients with different data, all taking part: the hypergradient is the derivative
    of the *federated* lower level (the mean of the local maps in every round). The average of
    the clients' own ITD hypergradients -- what a client could compute alone -- is not it:
    that is the client drift aggregation removes."""
    sim, algo, model, x, y, batches = setup(num_clients=3)
    ref = Reference(algo, model, batches)

    state, _ = sim.step(algo.init(x, y, {}), 0)

    got = hypergradient(algo, x, state)
    assert_close(got, unrolled_hypergradient(ref, [0, 1, 2], x, y, rounds=2, steps=2))
    local = mean([unrolled_hypergradient(ref, [c], x, y, rounds=2, steps=2) for c in range(3)])
    gap = sum(float((got[k] - local[k]).norm() ** 2) for k in x) ** 0.5
    scale = sum(float(got[k].norm() ** 2) for k in x) ** 0.5
    assert gap > 0.01 * scale  # a structural gap: measured 0.80 * scale on every kernel


# ---------------------------------------------------------------------- (c) communication
@pytest.mark.parametrize("rounds", [1, 3])
def test_an_iteration_costs_two_rounds_per_lower_level_round_plus_one(rounds):
    sim, algo, *_, x, y, _ = setup(num_clients=4, same_data=True, inner_rounds=rounds)
    sim.algorithm = algo = AggITD(**{**algo.__dict__, "clients_per_phase": 3})
    state = algo.init(x, y, {})
    for q in range(2):
        state, record = sim.step(state, q)
        assert record.communication_rounds == 2 * rounds + 1
        assert len(record.ledger) == 3 * (2 * rounds + 1)
        assert record.metrics["itd_complete"] == 1.0
    assert state.round == 2


def spoiling(phases):
    """Every update of the listed phases comes back NaN (so the engine rejects it)."""
    return Recorder(nan_where(lambda task: task.phase in phases))


def test_a_backward_round_without_results_abandons_the_hypergradient_only():
    sim, algo, model, x, y, batches = setup()
    clean, _ = sim.step(algo.init(x, y, {}), 0)
    sim.backend = spoiling(["itd.0"])

    state, record = sim.step(algo.init(x, y, {}), 0)

    assert record.metrics["itd_complete"] == 0.0 and "hypergrad_norm" not in record.metrics
    assert sorted(record.rejected["itd.0"]) == [0, 1, 2] and set(record.rejected) == {"itd.0"}
    assert all(torch.equal(state.x[k], x[k]) for k in x)  # x stays
    assert all(torch.equal(state.y[k], clean.y[k]) for k in y)  # the lower level went on
    # the next iteration starts a fresh tape and completes
    sim.backend = SequentialBackend()
    _, record = sim.step(state, 1)
    assert record.metrics["itd_complete"] == 1.0


def test_a_lower_level_round_without_results_leaves_y_and_skips_its_backward_round():
    """inner.1 aggregates nothing: y^2 = y^1, round 1's map is the identity and itd.1 is not
    sent; the hypergradient is ITD through round 0 alone (one client: torch.func over tau
    steps)."""
    sim, algo, model, x, y, batches = setup(num_clients=1, local_steps=3)
    ref = Reference(algo, model, batches)
    sim.backend = spoiling(["inner.1"])

    state, record = sim.step(algo.init(x, y, {}), 0)

    assert record.communication_rounds == 2 * algo.inner_rounds  # itd.1 skipped
    assert "itd.1" not in {e.phase for e in record.ledger}
    assert state.tape["moved"].tolist() == [True, False]
    assert_close(hypergradient(algo, x, state), unrolled_hypergradient(ref, [0], x, y, 1, 3))


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"inner_rounds": 0}, "inner_rounds\n  Input should be greater than or equal to 1"),
        ({"local_steps": 0}, "local_steps\n  Input should be greater than or equal to 1"),
        ({"inner_lr": 0.0}, "inner_lr\n  Input should be greater than 0"),
        (
            {"clients_per_phase": 0},
            "clients_per_phase\n  Input should be greater than or equal to 1",
        ),
        ({"max_hypergrad_norm": -1.0}, "max_hypergrad_norm\n  Input should be greater than 0"),
    ],
)
def test_bad_hyperparameters(kw, message):
    with pytest.raises(ValueError, match=message):
        AggITD(outer_names=("a",), inner_names=("b",), **kw)


def digits_config(**overrides):
    data = {
        "seed": 0,
        "rounds": 20,
        "eval_every": 20,
        "data": {"name": "digits"},
        "partition": {"kind": "iid"},
        "model": {"name": "mlp", "hidden": [64]},
        "task": {"name": "hyper_representation", "inner_l2": 0.01},
        "fleet": {"num_clients": 10, "capacities": [1.0]},
        "mask": {"policy": "none"},
        "algorithm": {
            "name": "aggitd",
            "inner_lr": 0.5,
            "outer_lr": 0.2,
            "inner_rounds": 2,
            "local_steps": 5,
            "clients_per_phase": 5,
        },
        "runtime": {"dtype": "float64"},
        **overrides,
    }
    return parse_config(data)


def test_config_takes_products_estimators_and_refuses_masks():
    accepted = digits_config().algorithm.accepted_estimators()
    assert {"autograd", "finite_difference"} <= set(accepted) and "cg" not in accepted
    with pytest.raises(ConfigError, match="trains the full model on every client"):
        digits_config(mask={"policy": "importance"})


# ------------------------------------------------------------------------------- (d) digits
@pytest.mark.float_sensitive
def test_digits_hyper_representation_trains():
    """10 iid clients, 5 sampled per communication round, R = 2 rounds of tau = 5 local steps,
    20 iterations (100 communication rounds), float64. Measured: test accuracy 0.103 untrained
    -> 0.894 (test loss 2.316 -> 0.601), the same on the default, AVX2 and AVX-512 kernels
    (losses 0.60134154201758 / ...814 / ...814). Seeds 1 and 2 (default kernels): 0.128 ->
    0.914 and 0.025 -> 0.914. Margins 0.044 and 0.19, against no change in four digits
    between kernels."""
    cfg = digits_config()
    before = untrained_metrics(cfg)["test_accuracy"]

    result = run(cfg, progress=False, save=False)

    assert result.final["test_accuracy"] >= 0.85
    assert result.final["test_accuracy"] >= before + 0.6
    assert result.totals["communication_rounds"] == 20 * 5
