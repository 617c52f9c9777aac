"""FedMBO (Alg. 1 + PHE Alg. 2 of papers/fedmbo.txt) on the engine: an iteration checked by hand."""

import pytest
import torch

from radbo.algorithms.fedmbo import FedMBO
from radbo.problem import Batch
from radbo.randomness import derive_seed
from tests.helpers import TOY_TASK as TASK
from tests.helpers import leaf, toy_clients, toy_mlp, toy_simulation


def setup(num_clients=4, n=3, T=2, N=4, seed=0, **kw):
    """Every client holds the same 12 + 8 samples of the toy 5-4-3 MLP problem, and batches
    hold all of them, so every gradient and product is deterministic and the iteration can be
    recomputed by hand."""
    toy = toy_mlp(20)
    algo = FedMBO(
        outer_names=tuple(toy.x),
        inner_names=tuple(toy.y),
        inner_lr=0.5,
        outer_lr=0.3,
        inner_steps=T,
        batch_size=100,
        outer_batch_size=100,
        neumann_terms=N,
        eta=0.5,
        clients_per_phase=n,
        seed=seed,
        **kw,
    )
    sim = toy_simulation(algo, toy, toy_clients(num_clients, same_data=True), seed=seed)
    features, labels = toy.features, toy.labels
    batches = (Batch(features[:12], labels[:12]), Batch(features[12:], labels[12:]))
    return sim, algo, toy.model, toy.x, toy.y, batches


def by_hand(algo, model, x, y, batches, round_=0):
    """Alg. 1 with full batches: T gradient steps on y, then the PHE chains, then the x step."""
    inner_b, outer_b = batches

    def g(xx, yy):
        return TASK.inner_loss(model, xx, yy, {}, inner_b)

    def f(xx, yy):
        return TASK.outer_loss(model, xx, yy, {}, outer_b)

    for _ in range(algo.inner_steps):
        yl = leaf(y)
        grads = torch.autograd.grad(g(x, yl), list(yl.values()))
        y = {k: t - algo.inner_lr * d for (k, t), d in zip(y.items(), grads, strict=True)}
    gen = torch.Generator().manual_seed(derive_seed(algo.seed, round_, 0xFED))
    terms = torch.randint(0, algo.neumann_terms, (algo.clients_per_phase,), generator=gen)
    xl, yl = leaf(x), leaf(y)
    fx = torch.autograd.grad(f(xl, yl), list(xl.values()) + list(yl.values()))
    d, fy = fx[: len(x)], fx[len(x) :]
    hs = []
    for n_i in terms.tolist():
        p = [algo.neumann_terms * algo.eta * t for t in fy]
        for _ in range(n_i):
            yl = leaf(y)
            gy = torch.autograd.grad(g(x, yl), list(yl.values()), create_graph=True)
            hp = torch.autograd.grad(gy, list(yl.values()), grad_outputs=p)
            p = [pi - algo.eta * hi for pi, hi in zip(p, hp, strict=True)]
        xl, yl = leaf(x), leaf(y)
        gy = torch.autograd.grad(g(xl, yl), list(yl.values()), create_graph=True)
        jp = torch.autograd.grad(gy, list(xl.values()), grad_outputs=p)
        hs.append([di - ji for di, ji in zip(d, jp, strict=True)])
    h = [torch.stack(parts).mean(0) for parts in zip(*hs, strict=True)]
    x = {k: t - algo.outer_lr * hk for (k, t), hk in zip(x.items(), h, strict=True)}
    return x, y, terms


def test_one_iteration_matches_alg1_and_phe_by_hand():
    sim, algo, model, x, y, batches = setup()
    state, record = sim.step(algo.init(x, y, {}), 0)
    want_x, want_y, terms = by_hand(algo, model, x, y, batches)
    # float64, the same steps in another summation order: measured <= 5.6e-17 absolute on
    # values <= 0.56 (default/avx2/avx512), within gamma_k * scale ~ 1e-14 for the ~100
    # roundings of T steps and the PHE chains; the bounds are four orders above that
    for k in want_y:
        torch.testing.assert_close(state.y[k], want_y[k], rtol=1e-12, atol=1e-12)
    for k in want_x:
        torch.testing.assert_close(state.x[k], want_x[k], rtol=1e-10, atol=1e-12)
    # T inner rounds + init + one per Neumann level any chain reaches + final
    assert record.communication_rounds == algo.inner_steps + int(terms.max()) + 2
    assert record.metrics["neumann_max_terms"] == float(terms.max())
    assert record.metrics["phe_chains_finished"] == 3.0
    assert state.chains == {} and state.round == 1
    # every communication round samples afresh: 3 of the 4 clients, or one per running chain
    phases = [e.phase for e in record.ledger]
    running = [int((terms >= level).sum()) for level in range(1, int(terms.max()) + 1)]
    assert len(phases) == 3 * (algo.inner_steps + 2) + sum(running)
    assert {p for p in phases if p.startswith("phe.") and p[4:].isdigit()} == {
        f"phe.{level}" for level in range(1, int(terms.max()) + 1)
    }
    # products are counted where they happen
    steps = [e for e in record.ledger if e.phase.startswith("phe.") and e.phase[4:].isdigit()]
    assert all((e.n_grad, e.n_hvp) == (1, 1) for e in steps)
    assert len(steps) == sum(running)


def test_neumann_expectation_is_the_truncated_series():
    """Averaged over N_i ~ U{0..N-1}, N eta (I - eta H)^{N_i} is eta sum_{j<N} (I - eta H)^j:
    with chains for every seed, the mean hypergradient step tends to Neumann's."""
    from radbo.hypergrad import Neumann
    from radbo.problem import bind_losses

    sim, algo, model, x, y, batches = setup(num_clients=6, n=6, T=1, N=3)
    steps = []
    for seed in range(40):
        algo_s = FedMBO(**{**algo.__dict__, "seed": seed})
        sim.algorithm = algo_s
        state, _ = sim.step(algo_s.init(x, y, {}), 0)
        steps.append({k: (x[k] - state.x[k]) / algo.outer_lr for k in x})
    mean = {k: torch.stack([s[k] for s in steps]).mean(0) for k in x}
    # the y the chains saw
    y1 = state.y
    outer, inner = bind_losses(TASK, model, {}, batches[0], batches[1])
    exact = Neumann(terms=3, eta=0.5)(outer, inner, x, y1).grad
    err = sum(float((mean[k] - exact[k]).norm() ** 2) for k in x) ** 0.5
    scale = sum(float(exact[k].norm() ** 2) for k in x) ** 0.5
    # float64 and integer draws: the 0.02 is the Monte Carlo error of 240 chains, not rounding
    # (0.0201 on default/avx2/avx512 alike); leaving out H^-1 gives 0.67
    assert err < 0.06 * scale


def test_a_chain_that_loses_its_client_ends_the_others_finish():
    sim, algo, model, x, y, batches = setup(num_clients=6, n=4, N=3, seed=1)
    # client 5 always drops out; whichever chain it serves ends there
    sim.dropout = [0.0] * 5 + [1.0]
    state, record = sim.step(algo.init(x, y, {}), 0)
    assert state.chains == {} and state.round == 1
    assert all(torch.isfinite(t).all() for t in state.x.values())
    assert 1.0 <= record.metrics.get("phe_chains_finished", 0.0) <= 4.0
    assert sum(len(v) for v in record.dropped.values()) <= 1


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"eta": 0.0}, "eta\n  Input should be greater than 0"),
        ({"neumann_terms": 0}, "neumann_terms\n  Input should be greater than or equal to 1"),
        (
            {"clients_per_phase": 0},
            "clients_per_phase\n  Input should be greater than or equal to 1",
        ),
        ({"max_hypergrad_norm": -1.0}, "max_hypergrad_norm\n  Input should be greater than 0"),
    ],
)
def test_bad_hyperparameters(kw, message):
    with pytest.raises(ValueError, match=message):
        FedMBO(outer_names=("a",), inner_names=("b",), **kw)
