"""Ragged cohorts: clients whose minibatches differ only in length run as one stacked cohort.

On non-iid fleets many clients hold fewer examples than a minibatch, so their draws are
shorter; without padding each length is a cohort of its own (the demo fleet of 100 clients:
39 and 50 cohorts per phase, most of one or two clients). Where the problem's losses are a
mean cross-entropy over examples and no layer mixes examples (``radbo.client.pads_minibatches``),
a stacked cohort pads the shorter minibatches with ``PAD_INDEX``, whose target is
``F.cross_entropy``'s ignored one, so every client's loss is the mean over its own examples.
Counts and FLOPs stay those of the unpadded client (the ledger is exact); values agree with
the sequential run to float64 rounding (1e-10 relative, as tests/simulation/test_batched.py
derives).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radbo.client import ClientBudget, ClientTask, Cohort, Prepared, pads_minibatches
from radbo.experiment import build
from radbo.problem import PAD_INDEX, PAD_TARGET, ClientData
from radbo.simulation import BatchedBackend
from tests.configs import small_config
from tests.helpers import OpLog, load_script
from tests.simulation.test_batched import assert_runs_agree, trajectory

F64 = {"runtime": {"dtype": "float64"}}


def test_a_padded_index_is_an_example_whose_target_cross_entropy_ignores():
    runtime = build(small_config()).simulation.runtime
    assert runtime.pads
    idx = torch.tensor([[0, 1, 2], [3, 4, PAD_INDEX]])
    batch = runtime.batch(idx)
    assert batch.targets[0].tolist() == runtime.labels[:3].tolist()
    assert batch.targets[1].tolist() == [*runtime.labels[3:5].tolist(), PAD_TARGET]
    assert torch.equal(batch.inputs[1, 2], runtime.features[-1])  # a real row: finite
    # one client's own (1-D) minibatch is never padded and is read as it is
    assert torch.equal(runtime.batch(torch.tensor([0, 1])).targets, runtime.labels[:2])


def test_cross_entropy_of_a_padded_minibatch_is_the_mean_over_its_examples():
    """What padding relies on, by hand: (l0 + l1 + 0) / 2 with the third target ignored."""
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, -5.0]], dtype=torch.float64)
    targets = torch.tensor([0, 1, PAD_TARGET])
    by_hand = (-torch.log_softmax(logits[0], 0)[0] - torch.log_softmax(logits[1], 0)[1]) / 2
    assert F.cross_entropy(logits, targets).item() == pytest.approx(by_hand.item(), rel=1e-15)
    assert F.cross_entropy(logits, targets).item() == pytest.approx(
        F.cross_entropy(logits[:2], targets[:2]).item(), rel=1e-15
    )


@pytest.mark.parametrize(
    ("overrides", "pads"),
    [
        ({}, True),  # hyper_representation on the MLP
        ({"algorithm": {"name": "fedavg"}}, True),
        ({"model": {"name": "cnn"}, "data": {"image_size": 8}}, False),  # BatchNorm
        ({"task": {"name": "vs_loss"}, "model": {"name": "vs_mlp"}}, False),  # weighted loss
    ],
)
def test_which_runs_pad(overrides, pads):
    exp = build(small_config(**overrides))
    runtime = exp.simulation.runtime
    assert runtime.pads is pads
    assert pads_minibatches(runtime.problem, runtime.model) is pads


def _cohort(prepared: list[Prepared]) -> Cohort:
    data = ClientData(inner=torch.arange(3), outer=torch.arange(3))
    task = ClientTask(0, 0, "p", {}, {}, data, seed=0, budget=ClientBudget(1.0, 1))
    return Cohort.stack([task] * len(prepared), prepared)


def test_a_cohort_pads_ragged_draws_at_the_end_and_reports_unpadded_sizes():
    ragged = frozenset({"batch", "steps"})
    short = Prepared(
        data={"batch": torch.tensor([1, 2]), "coords": torch.tensor([7])},
        steps={"steps": torch.tensor([[1], [2]])},
        num_steps=2,
        ragged=ragged,
    )
    long = Prepared(
        data={"batch": torch.tensor([3, 4, 5]), "coords": torch.tensor([8])},
        steps={"steps": torch.tensor([[3, 4], [5, 6]])},
        num_steps=2,
        ragged=ragged,
    )
    assert short.signature(pad=True) == long.signature(pad=True)
    assert short.signature() != long.signature()
    cohort = _cohort([short, long])
    assert cohort.data("batch").tolist() == [[1, 2, PAD_INDEX], [3, 4, 5]]
    assert cohort.data("coords").tolist() == [[7], [8]]  # not ragged: stacked as drawn
    assert cohort.step_data("steps", 1).tolist() == [[2, PAD_INDEX], [5, 6]]
    assert cohort.sizes("batch") == [2, 3]
    assert cohort.sizes("steps") == [1, 2]
    assert cohort.sizes("batch", "steps") == [3, 5]  # summed: a phase reading both
    assert cohort.step_samples("steps") == [2 * 1, 2 * 2]  # local steps x unpadded length


def test_unequal_step_counts_pad_each_step():
    ragged = frozenset({"steps"})
    one = Prepared(steps={"steps": torch.tensor([[1]])}, num_steps=1, ragged=ragged)
    two = Prepared(steps={"steps": torch.tensor([[3, 4], [5, 6]])}, num_steps=2, ragged=ragged)
    cohort = _cohort([one, two])
    assert cohort.step_data("steps", 0).tolist() == [[1, PAD_INDEX], [3, 4]]
    # the first client is past its last step: its last entry again (masked by local_steps)
    assert cohort.step_data("steps", 1).tolist() == [[1, PAD_INDEX], [5, 6]]


#: every algorithm whose draws are minibatches; the masked ones on the demo fleet's submodels
MASKED = ("rabo", "fedavg", "simfbo", "shrofbo", "fedsvrbgd_fo")
FULL_MODEL = ("fedmbo", "fednest", "lfednest", "aggitd", "fedmsa")


@pytest.fixture
def mixed(monkeypatch):
    """For each stacked cohort: whether its clients' minibatches differ in length."""
    seen: list[bool] = []
    original = Cohort.stack.__func__  # type: ignore[attr-defined]

    def spy(cls, tasks, prepared):
        keys = prepared[0].ragged
        seen.append(any(len({p.size(k) for p in prepared}) > 1 for k in keys))
        return original(cls, tasks, prepared)

    monkeypatch.setattr(Cohort, "stack", classmethod(spy))
    return seen


@pytest.mark.float_sensitive
@pytest.mark.parametrize("algorithm", MASKED + FULL_MODEL)
def test_a_fleet_of_small_clients_runs_padded_cohorts_equal_to_sequential(mixed, algorithm):
    """40 clients of the demo's non-iid digits, most holding less than a minibatch: the
    batched run stacks clients of different minibatch lengths (padded), and its states,
    metrics and ledger are those of the sequential run (float64, 1e-10 relative)."""
    overrides: dict = dict(rounds=2, fleet={"num_clients": 40}, **F64)
    overrides["algorithm"] = {"name": algorithm}
    if algorithm in FULL_MODEL:
        overrides.update(mask={"policy": "none"}, fleet={"num_clients": 40, "capacities": [1.0]})
    seq = trajectory(overrides)
    assert mixed == []
    bat = trajectory(overrides, BatchedBackend())
    assert any(mixed)
    assert_runs_agree(seq, bat)


ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_counts_fewer_cohorts_and_operations_when_padded():
    """``benchmarks/padding.py`` at its smallest: 10 demo clients, FedAvg, one timed round;
    the padded side stacks no more cohorts than the split one and dispatches fewer
    operations than both others (the same arithmetic in fewer, larger calls)."""
    script = load_script(ROOT / "benchmarks" / "padding.py", "bench_padding")
    rows = script.measure(10, "fedavg", rounds=1)
    seq, split, padded = (rows[name] for name in script.SIDES)
    assert seq["cohorts_per_phase"] == 0
    assert 0 < padded["cohorts_per_phase"] <= split["cohorts_per_phase"]
    assert padded["ops"] < split["ops"] < seq["ops"]


def test_the_device_script_parses_and_names_scripts_that_exist():
    """``benchmarks/device_check.sh`` runs only on a lent GPU: here, its syntax and the
    scripts it calls."""
    path = ROOT / "benchmarks" / "device_check.sh"
    subprocess.run(["bash", "-n", str(path)], check=True)
    called = re.findall(r"\$PY (\S+\.py)", path.read_text())
    assert "benchmarks/gpu.py" in called and "benchmarks/vs_pfl.py" in called
    assert all((ROOT / script).is_file() for script in called)
    # each step's time limits (seconds); the combinations the script's header names fit a
    # lent machine's 600 s per command, with room for the installation and nvidia-smi
    limits: dict[str, int] = {}
    for name, limit in re.findall(r"^\s*step (\w+) (\d+) ", path.read_text(), re.MULTILINE):
        limits[name] = limits.get(name, 0) + int(limit)
    combinations = (
        "test_cuda,compile,gpu,profile",
        "test_cuda,graphs",
        "graphs_steps,vs_pfl,workers",
    )
    for combination in combinations:
        assert sum(limits[name] for name in combination.split(",")) <= 590, (combination, limits)


def test_the_operation_map_sums_to_the_round_and_names_radbo_functions():
    """``benchmarks/op_sites.py`` at 10 demo clients: every operation of the round is counted
    once, as a view or not (the totals equal ``benchmarks/padding.py``'s count of the same
    round), and the minibatch draws are attributed to the function that makes them."""
    sites = load_script(ROOT / "benchmarks" / "op_sites.py", "bench_op_sites")
    counter = sites.count_round(10, "rabo")
    padding = load_script(ROOT / "benchmarks" / "padding.py", "bench_padding")
    side = padding.make_side(10, "rabo", "batched, padded")
    side.step()
    side.step()
    ops, _ = padding.counted_round(side)
    assert sum(counter.sites.values()) + sum(counter.site_views.values()) == ops
    assert sum(counter.ops.values()) == sum(counter.sites.values())
    # RABO's inner phase draws T minibatches per client: T permutations, a stack and a take
    drawn = counter.sites["radbo/problem.py:draw_steps"]
    assert (
        0 < counter.ops["take"] < drawn
        and counter.ops["randperm"] >= drawn - 2 * counter.ops["take"]
    )
    assert all(s.startswith("radbo/") or s == "(outside radbo)" for s in counter.sites)


@pytest.mark.parametrize("lead", [(), (4,)], ids=["one draw", "per step"])
def test_padded_stack_is_padding_each_then_stacking(lead):
    """padded_stack equals padding every shorter tensor with PAD_INDEX and stacking them on the
    axis before the last (values, shape, contiguity), for a cohort's once-drawn minibatches
    and its per-step ones ([steps, batch]), with lengths from 1 to the longest and a longest
    beyond them all; it takes the same operations whatever the number of clients."""
    from radbo.client import padded_stack

    gen = torch.Generator().manual_seed(len(lead))
    counts = []
    for clients in (2, 9, 40):
        tensors = [
            torch.randint(
                0, 500, (*lead, int(torch.randint(1, 33, (), generator=gen))), generator=gen
            )
            for _ in range(clients)
        ]
        for longest in (max(t.shape[-1] for t in tensors), 33):
            padded = [F.pad(t, (0, longest - t.shape[-1]), value=PAD_INDEX) for t in tensors]
            expected = torch.stack(padded, dim=len(lead))
            with OpLog() as log:
                got = padded_stack(tensors, longest)
            assert got.shape == expected.shape and got.is_contiguous()
            assert torch.equal(got, expected)
            counts.append(len(log.names))
    assert len(set(counts)) == 1, counts  # not one padding per client
