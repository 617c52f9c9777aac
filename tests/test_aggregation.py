"""Parameter-wise coverage-weighted aggregation (RABO eqs. (6), (8)).

Float comparisons are exact (``torch.equal``, ``tolist``) where every operation is exact, and
otherwise held to a bound derived from the dtype's unit roundoff and the number of roundings
(tests/tolerances.py, issue 25). ``coverage_weighted_mean`` accumulates in float64 and rounds
the mean once to the updates' dtype.
"""

import pytest
import torch

from radbo.aggregation import (
    apply_mean,
    apply_normalized_step,
    apply_step,
    coverage_weighted_mean,
)
from radbo.autodiff import project_ball
from radbo.masks.coverage_report import coverage_stats
from tests.helpers import OpLog
from tests.tolerances import gamma

SHAPE = {"w": torch.Size([2, 3])}


def _three_clients():
    updates = [
        {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])},  # rows {0,1} x cols {0,1}
        {"w": torch.tensor([[10.0, 20.0]])},  # row {0} x cols {1,2}
        {"w": torch.tensor([[5.0, 7.0]])},  # row {1} x cols {0,1}
    ]
    index_sets = [
        {"w": (None, torch.tensor([0, 1]))},
        {"w": (torch.tensor([0]), torch.tensor([1, 2]))},
        {"w": (torch.tensor([1]), torch.tensor([0, 1]))},
    ]
    return updates, index_sets


def test_hand_computed_three_clients_uniform_weights():
    updates, index_sets = _three_clients()

    agg = coverage_weighted_mean(updates, index_sets, SHAPE)

    expected_mean = torch.tensor([[1.0, 6.0, 20.0], [4.0, 5.5, 0.0]])
    assert torch.equal(agg.mean["w"], expected_mean)
    assert agg.count["w"].tolist() == [[1, 2, 1], [2, 2, 0]]


@pytest.mark.float_sensitive
def test_hand_computed_three_clients_weighted_and_uncovered_unchanged():
    updates, index_sets = _three_clients()
    params = {"w": torch.full((2, 3), 100.0)}

    agg = coverage_weighted_mean(updates, index_sets, SHAPE, weights=[1.0, 1.0, 2.0])
    new = apply_step(params, agg, lr=0.5)

    # (1,0): (3 + 2*5)/3 ; (1,1): (4 + 2*7)/3 ; (1,2): nobody holds it
    expected_mean = torch.tensor([[1.0, 6.0, 20.0], [13.0 / 3.0, 6.0, 0.0]])
    # float32 result of float64 sums of small integers (exact) over a float64 division and a
    # cast: 2 roundings of the exact quotient, as for ``expected_mean`` (13 / 3 in Python,
    # cast): each within γ_2 relative, so they differ by at most 2 γ_2 |mean| (measured: 0,
    # default/avx2/avx512).
    torch.testing.assert_close(
        agg.mean["w"], expected_mean, rtol=2 * gamma(2, torch.float32), atol=0.0
    )
    assert agg.weight["w"].tolist() == [[1.0, 2.0, 1.0], [3.0, 3.0, 0.0]]
    # p - 0.5 * mean in float32 on both sides: the mean's 2 roundings and the subtraction's
    # (0.5 * mean is exact) are 3, each relative to |p| + 0.5 |mean| <= 100 + 0.5 * 20 = 110
    # (measured: 0, default/avx2/avx512)
    torch.testing.assert_close(
        new["w"],
        100.0
        - 0.5
        * expected_mean.masked_fill(
            torch.tensor([[False, False, False], [False, False, True]]), 0.0
        ),
        rtol=0.0,
        atol=2 * gamma(3, torch.float32) * 110.0,
    )
    assert new["w"][1, 2] == 100.0


@pytest.mark.float_sensitive
def test_full_masks_reduce_to_plain_average():
    gen = torch.Generator().manual_seed(0)
    updates = [{"w": torch.randn(2, 3, generator=gen)} for _ in range(4)]
    index_sets = [{"w": (None, None)} for _ in range(4)]

    agg = coverage_weighted_mean(updates, index_sets, SHAPE)

    stacked = torch.stack([u["w"] for u in updates])
    plain = stacked.mean(0)
    # float32 mean of 4 terms: 3 roundings of the sum (the division by 4 is exact), at most
    # γ_3 Σ|u_i| / 4; coverage_weighted_mean sums in float64 and rounds once to float32, at most
    # u |mean| + γ_4(float64) Σ|u_i| / 4. Together below γ_4 (float32) times the mean of
    # |u_i|, elementwise (measured: 0.23 of it, 6e-8, on default/avx2/avx512).
    bound = gamma(4, torch.float32) * stacked.abs().mean(0)
    assert bool(((agg.mean["w"] - plain).abs() <= bound).all())
    assert (agg.count["w"] == 4).all()


def test_apply_mean_replaces_only_covered_coordinates():
    updates, index_sets = _three_clients()
    agg = coverage_weighted_mean(updates, index_sets, SHAPE)

    out = apply_mean({"w": torch.full((2, 3), -1.0)}, agg)

    assert out["w"].tolist() == [[1.0, 6.0, 20.0], [4.0, 5.5, -1.0]]


def test_coverage_stats_min_over_trained_coordinates():
    updates, index_sets = _three_clients()
    agg = coverage_weighted_mean(updates, index_sets, SHAPE)

    stats = coverage_stats(agg.count, ["w"])

    assert stats.min_coverage == 1
    assert stats.untrained_fraction == 1 / 6
    assert stats.histogram == [1, 2, 3]


def test_shape_mismatch_is_rejected():
    updates = [{"w": torch.zeros(2, 2)}]
    index_sets = [{"w": (None, None)}]
    try:
        coverage_weighted_mean(updates, index_sets, SHAPE)
    except ValueError as err:
        assert "shape" in str(err)
    else:  # pragma: no cover
        raise AssertionError("expected a ValueError")


# -- coverage-weighted and normalized aggregation (SPEC "Aggregation") -----------------------


def _random_masked_clients(n: int, gen: torch.Generator):
    shape = torch.Size([4, 5])
    updates, index_sets = [], []
    for _ in range(n):
        rows = torch.randperm(4, generator=gen)[: int(torch.randint(1, 5, (1,), generator=gen))]
        cols = torch.randperm(5, generator=gen)[: int(torch.randint(1, 6, (1,), generator=gen))]
        rows, cols = rows.sort().values, cols.sort().values
        updates.append({"w": torch.randn(len(rows), len(cols), generator=gen, dtype=torch.float64)})
        index_sets.append({"w": (rows, cols)})
    return {"w": shape}, updates, index_sets


def test_normalized_hand_computed_rho_per_coordinate():
    # two clients on a 3-vector: client 0 holds {0, 1} with ||a|| = 2, client 1 holds {1, 2}
    # with ||a|| = 6; weights 1 and 3
    h = [{"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([4.0, 8.0])}]
    idx = [{"w": (torch.tensor([0, 1]),)}, {"w": (torch.tensor([1, 2]),)}]

    agg = coverage_weighted_mean(h, idx, {"w": torch.Size([3])}, [1.0, 3.0], scales=[2.0, 6.0])
    new = apply_normalized_step({"w": torch.zeros(3)}, agg, lr=0.5)

    # coord 0: h = 1, rho = 2 ; coord 1: h = (2 + 12)/4 = 3.5, rho = (2 + 18)/4 = 5 ;
    # coord 2: h = 8, rho = 6
    assert agg.mean["w"].tolist() == [1.0, 3.5, 8.0]
    assert agg.scale["w"].tolist() == [2.0, 5.0, 6.0]
    assert new["w"].tolist() == [-0.5 * 2.0 * 1.0, -0.5 * 5.0 * 3.5, -0.5 * 6.0 * 8.0]


@pytest.mark.float_sensitive
def test_normalized_with_full_masks_is_shrofbo_eq8():
    gen = torch.Generator().manual_seed(1)
    n, shape = 4, torch.Size([3, 2])
    h = [{"w": torch.randn(shape, generator=gen, dtype=torch.float64)} for _ in range(n)]
    p = [0.1, 0.2, 0.3, 0.4]
    a_norms = [1.0, 3.0, 7.0, 10.0]
    x = {"w": torch.randn(shape, generator=gen, dtype=torch.float64)}

    agg = coverage_weighted_mean(h, [{"w": (None, None)}] * n, {"w": shape}, p, scales=a_norms)
    new = apply_normalized_step(x, agg, lr=0.3)

    p_tilde = [pi / sum(p) for pi in p]  # client weights normalized over the sample
    rho = sum(pt * a for pt, a in zip(p_tilde, a_norms, strict=True))
    h_bar = sum(pt * hi["w"] for pt, hi in zip(p_tilde, h, strict=True))
    # float64: sums of 4 products and a few scalings, ~10 roundings of values below ~30 on
    # either side (|x| < 2.6, rho = 6.8, |h| < 3.6): 2 * 10 * u * 30 = 7e-14, bound 1e-12;
    # measured 0 (default/avx2/avx512)
    torch.testing.assert_close(new["w"], x["w"] - 0.3 * rho * h_bar, rtol=0.0, atol=1e-12)


@pytest.mark.float_sensitive
def test_normalized_with_unit_coefficients_and_equal_steps_is_rabo_coverage_average():
    gen = torch.Generator().manual_seed(2)
    shapes, q, index_sets = _random_masked_clients(5, gen)
    T = 7  # every client ran T local steps with a = 1: ||a_i||_1 = T, h_i = q_i / T
    h = [{"w": qi["w"] / T} for qi in q]
    x = {"w": torch.randn(4, 5, generator=gen, dtype=torch.float64)}

    normalized = apply_normalized_step(
        x, coverage_weighted_mean(h, index_sets, shapes, scales=[float(T)] * 5), lr=0.2
    )
    rabo = apply_step(x, coverage_weighted_mean(q, index_sets, shapes), lr=0.2)

    # float64: q_i / T and back (x T over ||a_i||_1 = T), sums of <= 5 terms: ~10 roundings of
    # values below ~10 on either side, 2 * 10 * u * 10 = 2e-14; measured 2.2e-16
    # (default/avx2/avx512)
    torch.testing.assert_close(normalized["w"], rabo["w"], rtol=0.0, atol=1e-12)


@pytest.mark.float_sensitive
def test_project_ball_scales_only_outside_the_ball():
    v = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}  # global norm 5

    assert project_ball(v, 10.0) is v
    out = project_ball(v, 1.0)
    # the norm 5 is exact; 1 / 5 and the product round once each (float64 or float32), the
    # float32 result at most once more, and the expected 0.6, 0.8 once: 4 roundings in all
    rtol = gamma(4, torch.float32)
    torch.testing.assert_close(out["a"], torch.tensor([0.6]), rtol=rtol, atol=0.0)
    torch.testing.assert_close(out["b"], torch.tensor([0.8]), rtol=rtol, atol=0.0)


def test_scattering_a_block_equals_adding_to_the_selected_cartesian_product():
    """radbo.aggregation._add_at (one index_add_ per indexed dimension, or one in-place addition
    for a full index set) leaves every coordinate bitwise equal to indexing the Cartesian
    product of the kept indices with meshgrid and adding there."""
    from radbo.masks.index import add_at as _add_at

    gen = torch.Generator().manual_seed(3)
    shape = (6, 5, 3, 2)
    for trial in range(20):
        index = tuple(
            None
            if torch.rand((), generator=gen) < 0.4
            else torch.sort(torch.randperm(n, generator=gen)[: 1 + trial % n]).values
            for n in shape
        )
        lists = [torch.arange(n) if i is None else i for i, n in zip(index, shape, strict=True)]
        key = torch.meshgrid(*lists, indexing="ij")
        start = torch.randn(shape, generator=gen, dtype=torch.float64)
        value = torch.randn(key[0].shape, generator=gen, dtype=torch.float64)
        expected = start.clone()
        expected[key] += value
        got = start.clone()
        _add_at(got, index, value)
        assert torch.equal(got, expected)
        expected[key] += 0.25
        _add_at(got, index, 0.25)
        assert torch.equal(got, expected)


def _random_index_sets(gen, shape, clients, *, whole=0.3):
    """Structured index sets of ``clients`` clients for a tensor of ``shape``: each dimension
    kept whole or a random sorted subset; some clients hold the whole tensor."""
    sets = []
    for _ in range(clients):
        if torch.rand((), generator=gen) < whole:
            sets.append((None,) * len(shape))
            continue
        sets.append(
            tuple(
                None
                if torch.rand((), generator=gen) < 0.4
                else torch.sort(
                    torch.randperm(n, generator=gen)[: 1 + int(torch.randint(n, (), generator=gen))]
                ).values
                for n in shape
            )
        )
    return sets


def _dense_holder_sums(entries, rows, size):
    """holder_sums the long way: every client's dense 0/1 holding (dense_mask) times its
    coefficient in each row, added client by client in float64."""
    from radbo.masks.index import dense_mask

    expected = torch.zeros((len(rows), *size), dtype=torch.float64)
    for i, entry in enumerate(entries):
        held = dense_mask({"t": entry}, {"t": size})["t"].to(torch.float64)
        for r, row in enumerate(rows):
            expected[r] += row[i] * held
    return expected


@pytest.mark.parametrize("shape", [(7,), (6, 5), (6, 5, 3, 2), (4, 1, 3)])
def test_holder_sums_equal_the_sum_of_dense_holdings(shape):
    """holder_sums (one contraction of per-dimension indicator rows) equals, exactly, adding
    every client's dense 0/1 holding (dense_mask) times its integer coefficient, for each of
    two coefficient rows at once; no clients gives zeros."""
    from radbo.masks.index import holder_sums

    gen = torch.Generator().manual_seed(len(shape))
    size = torch.Size(shape)
    for clients in (0, 1, 3, 40):
        sets = _random_index_sets(gen, shape, clients)
        rows = [[float(torch.randint(0, 50, (), generator=gen)) for _ in sets] for _ in range(2)]
        expected = _dense_holder_sums(sets, rows, size)
        got = holder_sums(sets, rows, size)
        assert got.dtype == torch.float64 and got.shape == (2, *shape)
        assert torch.equal(got, expected)


def test_holder_sums_of_shared_entries_contract_distinct_entries_only():
    """Clients whose entries are the same tensors (a mask policy's selection shared by one
    capacity) are summed first: the result equals, exactly, the dense sum and the sum over
    equal but distinct tensors, and 40 or 400 such clients dispatch the same operations."""
    from radbo.masks.index import holder_sums

    size = torch.Size([6, 5])
    shared = [
        (None, None),
        (torch.tensor([0, 2, 5]), None),
        (torch.tensor([1]), torch.tensor([0, 4])),
    ]

    counts = []
    for clients in (40, 400):
        gen = torch.Generator().manual_seed(clients)
        entries = [shared[int(torch.randint(3, (), generator=gen))] for _ in range(clients)]
        rows = [[float(torch.randint(0, 50, (), generator=gen)) for _ in entries] for _ in range(2)]
        expected = _dense_holder_sums(entries, rows, size)
        copies = [tuple(None if t is None else t.clone() for t in e) for e in entries]
        with OpLog() as log:
            got = holder_sums(entries, rows, size)
        counts.append(len(log.names))
        assert torch.equal(got, expected)
        assert torch.equal(holder_sums(copies, rows, size), expected)
    assert counts[0] == counts[1]


def _scatter_case(gen, clients, shape):
    """``clients`` clients over three shared index entries of ``shape`` (a whole one, two
    pruned) and a few of their own, with float32 and float64 values and signed zeros."""
    shared = [
        (None,) * len(shape),
        tuple(torch.tensor([0, 2]) if d == 0 else None for d in range(len(shape))),
        tuple(torch.tensor([1, n - 1]) if n > 2 else torch.tensor([n - 1]) for n in shape),
    ]
    entries = [
        shared[int(torch.randint(3, (), generator=gen))]
        if i % 7
        else _random_index_sets(gen, shape, 1)[0]
        for i in range(clients)
    ]
    values = []
    for i, entry in enumerate(entries):
        kept = tuple(n if idx is None else idx.numel() for n, idx in zip(shape, entry, strict=True))
        v = torch.randn(kept, generator=gen, dtype=torch.float32 if i % 2 else torch.float64)
        v.view(-1)[0] = -0.0
        values.append(v)
    return entries, values


@pytest.mark.parametrize("shape", [(7,), (6, 5), (4, 1, 3)])
@pytest.mark.parametrize("chunk", [None, 5])
def test_add_at_many_flat_is_bitwise_add_at_client_after_client(shape, chunk, monkeypatch):
    """The flat scatter (one ordered accumulation per chunk, the GPU default) equals add_at
    called client after client, bitwise: tensors of two dtypes, scalars, shared and own
    entries, chunks of one client or many; the CPU default is the loop itself."""
    from radbo.masks import index as index_module
    from radbo.masks.index import add_at, add_at_many

    if chunk is not None:
        monkeypatch.setattr(index_module, "_SCATTER_CHUNK", chunk)
    gen = torch.Generator().manual_seed(len(shape))
    entries, values = _scatter_case(gen, 60, shape)
    scalars = [float(torch.rand((), generator=gen)) for _ in entries]
    for vals in (values, scalars):
        loop = torch.randn(shape, dtype=torch.float64, generator=gen)
        flat, default = loop.clone(), loop.clone()
        for entry, value in zip(entries, vals, strict=True):
            add_at(loop, entry, value)
        add_at_many(flat, entries, vals, flat=True)
        add_at_many(default, entries, vals)
        assert torch.equal(flat, loop) and torch.equal(default, loop)


def test_add_at_many_takes_the_same_operations_for_40_or_400_clients_of_shared_entries():
    """Past the per-client views, a flat scatter's operations do not grow with the clients
    whose entries are shared."""
    from radbo.masks.index import add_at_many

    counts = []
    for clients in (40, 400):
        entries, values = _scatter_case(torch.Generator().manual_seed(0), clients, (6, 5))
        entries = [e for i, e in enumerate(entries) if i % 7]  # the shared ones only
        values = [v for i, v in enumerate(values) if i % 7]
        target = torch.zeros(6, 5, dtype=torch.float64)
        with OpLog() as log:
            add_at_many(target, entries, values, flat=True)
        counts.append(len(log.launched))
    assert counts[0] == counts[1]


def test_add_at_many_refuses_values_that_do_not_fit():
    from radbo.masks.index import add_at_many

    target = torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="2 index entries but 1 values"):
        add_at_many(target, [(None,), (None,)], [1.0])
    with pytest.raises(ValueError, match="a value of 3 elements for 4 coordinates"):
        add_at_many(target, [(None,)], [torch.ones(3)], flat=True)


def test_holder_sums_reject_a_coefficient_count_that_does_not_match():
    from radbo.masks.index import holder_sums

    with pytest.raises(ValueError, match=r"2 index entries but coefficient rows of \[1\]"):
        holder_sums([(None,), (None,)], [[1.0]], torch.Size([3]))


def _client_by_client(updates, index_sets, shapes, weights):
    """The aggregation as it was before holder_sums: every client's weight and holding
    scattered one client after the other, in client order, in float64."""
    from radbo.masks.index import add_at

    mean, den_out, count = {}, {}, {}
    for name, shape in shapes.items():
        num = torch.zeros(shape, dtype=torch.float64)
        den = torch.zeros(shape, dtype=torch.float64)
        cnt = torch.zeros(shape, dtype=torch.int64)
        for update, index_set, w in zip(updates, index_sets, weights, strict=True):
            index = index_set[name]
            add_at(num, index, w * update[name].to(torch.float64))
            add_at(den, index, float(w))
            if w > 0:
                add_at(cnt, index, 1)
        mean[name] = torch.where(den > 0, num / den.clamp_min(1e-300), 0.0).to(torch.float32)
        den_out[name], count[name] = den.to(torch.float32), cnt
    return mean, den_out, count


def _random_clients(gen, shapes, clients, weights):
    """``clients`` clients' structured index sets (:func:`_random_index_sets`), random updates
    of the shapes they select and weights of the kind ``weights`` ("ones", "integers",
    "fractions"), drawn from ``gen`` in that order."""
    per_tensor = {n: _random_index_sets(gen, s, clients) for n, s in shapes.items()}
    index_sets = [{n: per_tensor[n][i] for n in shapes} for i in range(clients)]
    updates = [
        {
            n: torch.randn(
                tuple(s[d] if idx is None else idx.numel() for d, idx in enumerate(sets[n])),
                generator=gen,
            )
            for n, s in shapes.items()
        }
        for sets in index_sets
    ]
    w = {  # all three drawn, whichever is used: the same stream for every kind
        "ones": [1.0] * clients,
        "integers": [float(torch.randint(0, 30, (), generator=gen)) for _ in range(clients)],
        "fractions": [float(torch.rand((), generator=gen)) for _ in range(clients)],
    }[weights]
    return index_sets, updates, w


@pytest.mark.parametrize(
    "weights", ["ones", "integers", "fractions"], ids=["unit", "integer", "fractional"]
)
def test_coverage_weighted_mean_is_bitwise_the_client_by_client_sum(weights):
    """Whatever the weights (the unit default and integer sample counts take holder_sums'
    path, fractional ones the per-client one), the mean, summed weights and counts are
    bitwise those of scattering client after client in client order: the numerator's
    additions keep their order, and the summed weights are exact integers either way."""
    gen = torch.Generator().manual_seed(11)
    shapes = {"conv": torch.Size([6, 5, 3, 3]), "fc": torch.Size([8, 6]), "b": torch.Size([8])}
    clients = 12
    index_sets, updates, w = _random_clients(gen, shapes, clients, weights)
    w[3] = 0.0  # a client of weight 0 holds nothing
    agg = coverage_weighted_mean(updates, index_sets, shapes, w)
    mean, den, count = _client_by_client(updates, index_sets, shapes, w)
    for name in shapes:
        assert torch.equal(agg.mean[name], mean[name]), name
        assert torch.equal(agg.weight[name], den[name]), name
        assert torch.equal(agg.count[name], count[name]), name


@pytest.mark.parametrize(
    "weights", ["ones", "integers", "fractions"], ids=["unit", "integer", "fractional"]
)
def test_coverage_weighted_mean_is_bitwise_the_same_on_more_threads(weights):
    """aggregation_threads(n) runs the aggregation on n intra-op threads; mean, summed weights,
    counts and scale are bitwise those of one thread (elementwise arithmetic in client order,
    exact integer contractions), on tensors big enough to be split between threads (PyTorch
    splits elementwise work above 32,768 elements), masked and whole; the process's thread
    count is back afterwards, also after an error."""
    from radbo.aggregation import aggregation_threads

    gen = torch.Generator().manual_seed(5)
    shapes = {"big": torch.Size([300, 400]), "conv": torch.Size([64, 32, 3, 3])}
    clients = 7
    index_sets, updates, w = _random_clients(gen, shapes, clients, weights)
    scales = [float(torch.rand((), generator=gen)) for _ in range(clients)]
    before = torch.get_num_threads()
    one = coverage_weighted_mean(updates, index_sets, shapes, w, scales)
    for threads in (2, 3):
        seen = []
        with aggregation_threads(threads):
            many = coverage_weighted_mean(updates, index_sets, shapes, w, scales)
            seen.append(torch.get_num_threads())
        assert seen == [before] and torch.get_num_threads() == before
        for name in shapes:
            for part in ("mean", "weight", "count", "scale"):
                assert torch.equal(getattr(many, part)[name], getattr(one, part)[name]), part
    with aggregation_threads(2), pytest.raises(ValueError, match="missing tensor"):
        coverage_weighted_mean([{}], [{}], shapes)
    assert torch.get_num_threads() == before


def test_aggregation_threads_are_used_inside_and_checked():
    """Inside coverage_weighted_mean the process runs on at least the threads asked for
    (never fewer than it has) where a tensor reaches PyTorch's grain size; a count that is
    not an integer >= 1 is refused."""
    from unittest import mock

    import radbo.aggregation as aggregation

    seen = []
    real = aggregation._weighted_mean

    def spy(*args):
        seen.append(torch.get_num_threads())
        return real(*args)

    big = {"w": torch.Size([2, 16384])}  # PyTorch's grain size, 32,768 elements
    small = {"w": torch.Size([2, 16383])}
    before = torch.get_num_threads()
    with mock.patch.object(aggregation, "_weighted_mean", spy):
        coverage_weighted_mean([{"w": torch.ones(big["w"])}], [{}], big)
        with aggregation.aggregation_threads(before + 1):
            coverage_weighted_mean([{"w": torch.ones(big["w"])}], [{}], big)
            # tensors too small to be split: one thread's work, left to one
            coverage_weighted_mean([{"w": torch.ones(small["w"])}], [{}], small)
        with aggregation.aggregation_threads(1):  # never fewer than the process has
            coverage_weighted_mean([{"w": torch.ones(big["w"])}], [{}], big)
    assert seen == [before, before + 1, before, before]
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="aggregation_threads needs an integer >= 1"):
            with aggregation.aggregation_threads(bad):
                pass
