"""Unsound client updates (NaN/Inf, wrong shape, unknown tensor) are rejected and counted."""

from dataclasses import dataclass, replace

import pytest
import torch

from radbo.experiment import build
from radbo.simulation import update_problem
from tests.configs import small_config
from tests.helpers import OpLog


@dataclass
class Poisoned:
    """Wraps an algorithm so that ``spoil(update)`` replaces the updates of some clients."""

    inner: object
    clients: frozenset[int]
    spoil: object
    phases_hit: tuple[str, ...] = ("train.inner", "train.outer")

    @property
    def name(self):
        return self.inner.name

    def init(self, x, y, buffers):
        return self.inner.init(x, y, buffers)

    def model_state(self, state):
        return self.inner.model_state(state)

    def phases(self):
        def wrap(phase):
            if phase.name not in self.phases_hit:
                return phase

            def client(runtime, task):
                result = phase.client(runtime, task)
                if task.client not in self.clients:
                    return result
                return replace(result, update=self.spoil(result.update))

            return replace(phase, client=client)

        return tuple(wrap(p) for p in self.inner.phases())


def nan_everywhere(update):
    return {k: torch.full_like(t, float("nan")) for k, t in update.items()}


def first_tensor_truncated(update):
    out = dict(update)
    key = next(iter(out))
    out[key] = out[key].reshape(-1)[:-1]
    return out


def run_rounds(exp, rounds):
    return list(exp.simulation.iterate(exp.initial_state, rounds))


def test_poisoned_client_is_exactly_a_client_of_weight_zero():
    """Rejecting client 2 in every phase gives bitwise the run where its weight is 0 (exact
    on every kernel: coverage_weighted_mean adds the clients one after another in float64,
    a weight-0 client's exact zeros included)."""
    cfg = small_config(fleet={"capacities": [1.0, 0.5, 0.25]}, mask={"policy": "importance"})
    poisoned = build(cfg)
    sim = poisoned.simulation
    sim.algorithm = Poisoned(sim.algorithm, frozenset({2}), nan_everywhere)
    reference = build(cfg)
    reference.simulation.weights = [0.0 if c == 2 else 1.0 for c in range(10)]

    got = run_rounds(poisoned, 3)
    want = run_rounds(reference, 3)
    for (state, record), (ref_state, ref_record) in zip(got, want, strict=True):
        for block in ("x", "y"):
            for k, t in getattr(state, block).items():
                assert torch.equal(t, getattr(ref_state, block)[k]), (record.round, k)
                assert torch.isfinite(t).all()
        hit = [2] if 2 in record.clients else []
        expected = {"train.inner": hit, "train.outer": hit} if hit else {}
        assert record.rejected == expected
        assert record.metrics["rejected_updates"] == 2 * len(hit)
        assert ref_record.rejected == {} and ref_record.metrics["rejected_updates"] == 0
        # the rejected client's work is still charged
        assert [e.client for e in record.ledger] == [e.client for e in ref_record.ledger]
        assert record.as_dict()["rejected"] == expected


def test_wrong_shape_in_one_phase_only():
    cfg = small_config(fleet={"capacities": [1.0, 0.5]}, mask={"policy": "leading"})
    exp = build(cfg)
    exp.simulation.algorithm = Poisoned(
        exp.simulation.algorithm, frozenset({0, 3}), first_tensor_truncated, ("train.outer",)
    )
    ((_, record),) = run_rounds(exp, 1)
    assert record.rejected == {"train.outer": [c for c in (0, 3) if c in record.clients]}
    assert record.metrics["rejected_updates"] == len(record.rejected["train.outer"])


@pytest.mark.parametrize("algorithm", ["rabo", "shrofbo"])
def test_every_update_rejected_leaves_the_model_unchanged(algorithm):
    cfg = small_config(algorithm={"name": algorithm}, fleet={"capacities": [1.0, 0.5]})
    exp = build(cfg)
    exp.simulation.algorithm = Poisoned(
        exp.simulation.algorithm,
        frozenset(range(10)),
        nan_everywhere,
        ("train.inner", "train.outer", "train"),
    )
    before = exp.simulation.algorithm.model_state(exp.initial_state)
    state, record = run_rounds(exp, 2)[-1]
    after = exp.simulation.algorithm.model_state(state)
    assert sum(map(len, record.rejected.values())) == len(record.clients) * len(
        exp.simulation.algorithm.phases()
    )
    for k, t in before.items():
        assert torch.equal(after[k], t), k


def test_run_totals_count_rejections(monkeypatch):
    import radbo.experiment as experiment
    import radbo.experiment.runner as runner

    real_build = experiment.build

    def poisoned_build(config):
        exp = real_build(config)
        exp.simulation.algorithm = Poisoned(
            exp.simulation.algorithm, frozenset({1}), nan_everywhere
        )
        return exp

    monkeypatch.setattr(runner, "build", poisoned_build)
    cfg = small_config(rounds=2, baseline={"enabled": False})
    result = experiment.run(cfg, progress=False, save=False)
    rounds_with_1 = sum(1 in r["clients"] for r in result.rounds)
    assert rounds_with_1 > 0
    assert result.totals["rejected_updates"] == 2 * rounds_with_1
    assert all(r["rejected_updates"] == 2 * (1 in r["clients"]) for r in result.rounds)


S = {"w": torch.Size([3, 2]), "b": torch.Size([3])}
KEEP = {"w": (torch.tensor([0, 2]), None), "b": (torch.tensor([0, 2]),)}


@pytest.mark.parametrize(
    ("update", "problem"),
    [
        ({"w": torch.ones(2, 2), "b": torch.ones(2)}, None),
        ({"v:w": torch.ones(2, 2), "key:b": torch.zeros(2)}, None),
        ({"n": torch.ones(2, dtype=torch.int64)}, "'n' is not a model tensor"),
        ({"w": torch.ones(3, 2)}, "'w' has shape (3, 2), expected (2, 2)"),
        ({"v:b": torch.ones(2, 1)}, "'v:b' has shape (2, 1), expected (2,)"),
        ({"b": torch.tensor([0.0, float("-inf")])}, "'b' holds NaN or Inf"),
        ({"b": [0.0, 1.0]}, "'b' is a list, not a tensor"),
    ],
)
def test_update_problem_cases(update, problem):
    assert update_problem(update, KEEP, S) == problem


def test_integer_buffers_pass():
    shapes = {"num_batches_tracked": torch.Size([])}
    assert update_problem({"num_batches_tracked": torch.tensor(3)}, {}, shapes) is None


def test_screen_reads_every_update_of_a_phase_at_once():
    """screen's verdicts are update_problem's, client by client, while the NaN / Inf tests of
    the whole phase are read in one go: no scalar read per tensor (on a GPU, one host
    synchronisation per phase). A float64 update whose sum overflows but whose entries are
    finite (1e308 + 1e308) is sound; a float64 one with an Inf is not. Sums are accumulated
    in the update's own dtype, so a float32 update's (3e38 + 3e38) overflows too: sound after
    a second look, the one read it costs. A float16 update is summed in float32, so its
    60000 + 60000 needs no second look."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from radbo.client import ClientResult
    from radbo.simulation.screening import screen

    big = torch.tensor([1e308, 1e308], dtype=torch.float64)
    updates = [
        {"w": torch.ones(2, 2), "b": torch.ones(2)},  # sound
        {"w": torch.ones(2, 2), "b": torch.tensor([0.0, float("nan")])},  # NaN
        {"w": torch.ones(2, 2), "b": big},  # overflowing sum, finite entries: sound
        {"w": torch.ones(2, 2, dtype=torch.float64), "b": torch.tensor([1.0, float("inf")])},
        {"w": torch.ones(3, 2)},  # wrong shape
        {"w": torch.full((2, 2), float("nan"))},  # lost: never looked at
        {"w": torch.full((2, 2), float("nan"))},  # late: never looked at
    ]
    results = [
        ClientResult(client=10 + j, update=u, cost=None, rejected="bad" if j == 3 else None)
        for j, u in enumerate(updates)
    ]
    results[3] = replace(results[3], rejected=None)
    lost = [False] * 5 + [True, False]
    slow = [False] * 6 + [True]

    reads = []

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                reads.append(func)
            return func(*args, **(kwargs or {}))

    with Reads():
        screened = screen(results, [KEEP] * 7, lost, slow, S)
    assert screened.keep == [0, 2]
    assert screened.rejected == [11, 13, 14]
    assert (screened.dropped, screened.late) == ([15], [16])
    # the sums come back as one list; an elementwise test only where a sum is not finite
    # (the NaN, the Inf and the overflow), so a sound phase reads no scalar at all
    assert len(reads) == 3
    reads.clear()
    with Reads():
        assert screen(results[:1] * 50, [KEEP] * 50, [False] * 50, [False] * 50, S).keep == list(
            range(50)
        )
    assert reads == []
    big32 = ClientResult(
        client=1, update={"w": torch.ones(2, 2), "b": torch.tensor([3e38] * 2)}, cost=None
    )
    with Reads():
        assert screen([big32], [KEEP], [False], [False], S).keep == [0]
    assert len(reads) == 1
    reads.clear()
    big16 = ClientResult(
        client=2,
        update={"w": torch.ones(2, 2), "b": torch.tensor([6e4] * 2, dtype=torch.float16)},
        cost=None,
    )
    nan16 = ClientResult(
        client=3,
        update={"w": torch.ones(2, 2), "b": torch.tensor([6e4, float("nan")], dtype=torch.float16)},
        cost=None,
    )
    with Reads():
        assert screen([big16, nan16], [KEEP] * 2, [False] * 2, [False] * 2, S).keep == [0]
    assert len(reads) == 1  # the NaN's second look only
    verdicts = [update_problem(u, KEEP, S) for u in updates[:5]]
    assert [v is None for v in verdicts] == [True, False, True, False, False]


def test_a_stacked_cohorts_slices_are_screened_in_one_reduction_per_tensor():
    """A stacked cohort's updates are per-client slices of one tensor per name: the screen
    sums each such set of equally spaced windows in one reduction (rows of an as_strided
    view), and its verdicts are still every tensor's own (isfinite(t).all()), whatever else
    is in the phase: slices in another order, unequally spaced ones, 0-d and empty slices,
    transposed views, repeated tensors, overflowing float64 sums of finite entries."""
    from radbo.simulation.screening import _finite, _windows

    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 3, 4, generator=gen)
    base[2, 1, 3] = float("nan")
    base[5, 0, 0] = float("inf")
    scalars = torch.randn(6, generator=gen)
    scalars[4] = float("nan")
    huge = torch.full((4, 2), 1e308, dtype=torch.float64)
    huge[3, 1] = float("inf")
    other = torch.randn(5, 7, generator=gen)
    other[1, 6] = float("nan")
    tensors = [
        *[base[c] for c in (3, 0, 5, 1, 2, 4)],  # one storage, equally spaced, out of order
        *[scalars[c] for c in range(6)],  # 0-d slices
        *[huge[c] for c in range(4)],  # sums overflow, entries finite but in row 3
        other[0],  # unequally spaced rows of another storage
        other[1],
        other[3],
        other.t(),  # a transposed view of it
        torch.empty(0, 3),
        base[0],  # a repeat
    ]
    expected = [bool(torch.isfinite(t).all()) for t in tensors]
    assert _finite(tensors) == expected
    assert expected.count(False) == 6
    groups = _windows(tensors)
    # base's 6 slices (the repeat of base[0] on its own), the scalars' 6, huge's 4, the rest
    # one by one
    assert sorted(len(members) for members, _ in groups) == [1] * 6 + [4, 6, 6]
    for members, view in groups:
        for row, i in enumerate(members):
            torch.testing.assert_close(view[row], tensors[i], rtol=0, atol=0, equal_nan=True)

    stacked = torch.randn(6, 3, 4, generator=gen)
    cohort = [stacked[c] for c in range(6)]  # a sound stacked cohort's slices of one tensor
    with OpLog() as log:
        assert _finite(cohort) == [True] * 6
    # one sum and one cat (and a view, which launches nothing): not one sum per client
    ops = log.names
    assert ops == ["aten::as_strided", "aten::sum.dim_IntList", "aten::cat"], ops
