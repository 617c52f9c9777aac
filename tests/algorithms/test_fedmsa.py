"""FedMSA (Alg. 1 + eq. (10) of papers/fedmsa.txt) on the engine: rounds recomputed by hand."""

import pytest
import torch

from radbo.algorithms.fedmsa import FedMSA
from radbo.problem import sample_batch
from radbo.randomness import derive_seed
from tests.helpers import TOY_TASK as TASK
from tests.helpers import leaf, toy_clients, toy_mlp, toy_simulation


def setup(num_clients=3, **kw):
    """The toy 5-4-3 MLP problem, client c holding examples 20c..20c+11 (inner) and
    20c+12..20c+19 (outer)."""
    toy = toy_mlp(60)
    algo = FedMSA(
        outer_names=tuple(toy.x),
        inner_names=tuple(toy.y),
        outer_lr=0.2,
        inner_lr=0.5,
        v_lr=0.3,
        momentum=0.3,
        local_steps=3,
        batch_size=4,  # minibatches: every evaluation sees a different sample
        outer_batch_size=3,
        **kw,
    )
    sim = toy_simulation(algo, toy, toy_clients(num_clients), seed=3)
    return sim, algo, toy.model, toy.features, toy.labels, toy.x, toy.y


def maps(model, inner_b, outer_b, x, w, v):
    """P and S of eq. (10) by plain autograd (independent of radbo.hypergrad)."""
    xl, wl = leaf(x), leaf(w)
    f = TASK.outer_loss(model, xl, wl, {}, outer_b)
    fx = torch.autograd.grad(f, list(xl.values()) + list(wl.values()))
    g = TASK.inner_loss(model, xl, wl, {}, inner_b)
    gw = torch.autograd.grad(g, list(wl.values()), create_graph=True)
    vv = [v[k] for k in w]
    hv = torch.autograd.grad(gw, list(wl.values()), grad_outputs=vv, retain_graph=True)
    jv = torch.autograd.grad(gw, list(xl.values()), grad_outputs=vv)
    p = {k: fx[i] - jv[i] for i, k in enumerate(x)}
    s_w = {k: gw[i].detach() for i, k in enumerate(w)}
    s_v = {k: hv[i] - fx[len(x) + i] for i, k in enumerate(w)}
    return p, s_w, s_v


def batches(sim, round_, phase, client, draws):
    gen = torch.Generator().manual_seed(derive_seed(sim.seed, round_, phase + 1, client))
    feats, labs, data = sim.runtime.features, sim.runtime.labels, sim.clients[client]
    out = []
    for _ in range(draws):
        inner_b = sample_batch(feats, labs, data.inner, sim.algorithm.batch_size, gen)
        outer_b = sample_batch(feats, labs, data.outer, sim.algorithm.outer_batch_size, gen)
        out.append((inner_b, outer_b))
    return out


def add(a, b, s=1.0):
    return {k: a[k] + s * b[k] for k in a}


def test_three_rounds_match_eqs_5_and_6_by_hand():
    sim, algo, model, *_, x, y = setup()
    state = algo.init(x, y, {})
    v = {k: torch.zeros_like(t) for k, t in y.items()}
    prev = None
    h = q_w = q_v = None
    for r in range(3):
        state, record = sim.step(state, r, 0.0)
        (chosen,) = {e.client for e in record.ledger if e.phase == "train.local"}
        # eq. (5) on every client, then the average
        hs, qws, qvs = [], [], []
        for c in range(3):
            ((ib, ob),) = batches(sim, r, 0, c, 1)
            p1, sw1, sv1 = maps(model, ib, ob, x, y, v)
            if prev is not None:
                p0, sw0, sv0 = maps(model, ib, ob, *prev)
                p1 = add(p1, add(h, p0, -1.0), 1 - algo.momentum)
                sw1 = add(sw1, add(q_w, sw0, -1.0), 1 - algo.momentum)
                sv1 = add(sv1, add(q_v, sv0, -1.0), 1 - algo.momentum)
            hs.append(p1), qws.append(sw1), qvs.append(sv1)
        h = {k: sum(d[k] for d in hs) / 3 for k in x}
        q_w = {k: sum(d[k] for d in qws) / 3 for k in y}
        q_v = {k: sum(d[k] for d in qvs) / 3 for k in y}
        # eq. (6) on the chosen client, K = 1 in round 0
        steps = 1 if r == 0 else algo.local_steps
        draws = iter(batches(sim, r, 1, chosen, steps - 1))
        point, before = (x, y, v), None
        hk, qwk, qvk = h, q_w, q_v
        for _ in range(steps):
            if before is not None:
                ib, ob = next(draws)
                p1, sw1, sv1 = maps(model, ib, ob, *point)
                p0, sw0, sv0 = maps(model, ib, ob, *before)
                hk, qwk, qvk = (
                    add(hk, add(p1, p0, -1.0)),
                    add(qwk, add(sw1, sw0, -1.0)),
                    add(qvk, add(sv1, sv0, -1.0)),
                )
            before = point
            point = (
                add(point[0], hk, -algo.outer_lr),
                add(point[1], qwk, -algo.inner_lr),
                add(point[2], qvk, -algo.v_lr),
            )
        prev = (x, y, v)
        x, y, v = point
        for mine, theirs in (
            (state.x, x),
            (state.y, y),
            (state.v, v),
            (state.h, h),
            (state.q_w, q_w),
        ):
            for k in theirs:
                # float64, the same operations in the same order: measured 0 (bitwise) on
                # default/avx2/avx512; the bound leaves room for a reordered sum (~1e-16 per
                # rounding, gamma_k * scale ~ 1e-14 over three rounds) and no missing term
                torch.testing.assert_close(mine[k], theirs[k], rtol=1e-9, atol=1e-11)
        assert record.communication_rounds == 2
        assert state.round == r + 1
        local = [e for e in record.ledger if e.phase == "train.local"]
        # per local step the maps at two points, each with one joint product (H_ww v, H_xw v)
        assert len(local) == 1 and local[0].n_hvp == 2 * (steps - 1)


def test_no_momentum_and_momentum_differ_only_after_round_0():
    sim, algo, _, _, _, x, y = setup()
    s1, _ = sim.step(algo.init(x, y, {}), 0)
    sim.algorithm = algo.model_copy(update={"momentum": 1.0})
    s2, _ = sim.step(sim.algorithm.init(x, y, {}), 0)
    for k in x:
        assert torch.equal(s1.x[k], s2.x[k])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"momentum": 1.5}, "momentum\n  Input should be less than or equal to 1"),
        ({"local_steps": 0}, "local_steps\n  Input should be greater than or equal to 1"),
        ({"v_lr": 0.0}, "v_lr\n  Input should be greater than 0"),
    ],
)
def test_bad_hyperparameters(kw, message):
    with pytest.raises(ValueError, match=message):
        FedMSA(outer_names=("a",), inner_names=("b",), **kw)
