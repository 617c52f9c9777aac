"""Fleet size (issue 12, "Scale"): the limit a partition puts on the fleet and its error,
``[partition] allow_overlap``, packed client data, shared budgets, the vectorised availability
draw, and a 100,000-client fleet that builds and runs a round."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from radbo.config import ConfigError, parse_config
from radbo.data.partition import (
    ClassesPartition,
    DirichletPartition,
    IIDPartition,
    IndexParts,
    PartitionConfig,
    QDominantPartition,
    ShardsPartition,
    split_indices,
    split_parts,
)
from radbo.devices import load_catalog
from radbo.devices.budget import BudgetPlanner
from radbo.experiment import build
from radbo.experiment.build import ClientTable
from radbo.masks.structure import StructurePlan
from radbo.models import MLPConfig
from radbo.randomness import Stream, generator
from tests.configs import demo_dict


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fleet_config(num_clients: int, partition: dict[str, Any], **fleet: Any) -> Any:
    """The demo (digits, catalog devices) with a tiny model and ``num_clients`` clients."""
    data = demo_dict()
    data.update(
        rounds=1,
        partition=partition,
        model={"name": "mlp", "hidden": [8]},
        mask={"policy": "none"},
        algorithm={"name": "rabo", "inner_steps": 2, "batch_size": 4, "outer_batch_size": 4},
        estimator={"name": "cg", "max_iter": 2},
        baseline={"enabled": False},
    )
    data["fleet"].pop("capacities")
    data["fleet"].update(num_clients=num_clients, **fleet)
    return parse_config(data)


KINDS: dict[str, PartitionConfig] = {
    "iid": IIDPartition(),
    "dirichlet": DirichletPartition(alpha=0.3),
    "q_dominant": QDominantPartition(q=0.5),
    "shards1": ShardsPartition(classes_per_client=1),
    "shards2": ShardsPartition(classes_per_client=2),
    "classes": ClassesPartition(kind="classes"),
}


def overlapping(kind: PartitionConfig) -> PartitionConfig:
    return kind.model_copy(update={"allow_overlap": True})


# -- the limit and its error --------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["dirichlet", "iid"])
def test_too_large_fleet_error_names_the_real_limit(kind: str) -> None:
    # digits: 1,797 examples, 1,438 after test_fraction = 0.2; 2 per client (inner + outer)
    cfg = fleet_config(1000, {"kind": kind})

    with pytest.raises(ConfigError) as err:
        build(cfg)

    assert str(err.value) == (
        f"config error: fleet.num_clients = 1000: the {kind} partition cannot give 1000 "
        "clients at least one sample each for their inner and one for their outer data from "
        "the 1438 training examples of digits (after test_fraction = 0.2): at most 719 clients "
        "fit; use num_clients <= 719, or set [partition] allow_overlap = true to let clients "
        "share examples"
    )


def test_the_named_limit_builds_and_one_more_client_does_not() -> None:
    exp = build(fleet_config(719, {"kind": "iid"}))

    assert len(exp.clients) == 719
    assert int(exp.clients.inner.sizes().min()) == 1  # type: ignore[attr-defined]
    assert int(exp.clients.outer.sizes().min()) == 1  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="at most 719 clients fit; use num_clients <= 719"):
        build(fleet_config(720, {"kind": "iid"}))


def test_max_clients_hand_computed() -> None:
    ten = torch.arange(10) % 2
    eleven = torch.arange(11) % 3
    uneven = torch.tensor([0, 1, 1, 1, 2, 2, 2, 2])  # class sizes 1, 3, 4

    assert IIDPartition().max_clients(ten, 1) == 10
    assert IIDPartition().max_clients(ten, 2) == 5
    assert QDominantPartition(q=0.5).max_clients(ten, 3) == 3
    assert DirichletPartition().max_clients(ten, 1) == 5  # the split itself keeps 2
    assert DirichletPartition().max_clients(ten, 3) == 3
    # 11 examples in 2 shards each: 4 clients (8 shards of 1 or 2) leave one client 2 examples
    assert ShardsPartition(classes_per_client=2).max_clients(eleven, 3) == 3
    assert ShardsPartition(classes_per_client=1).max_clients(ten, 2) == 5
    assert ClassesPartition(kind="classes").max_clients(uneven, 1) == 3
    assert ClassesPartition(kind="classes").max_clients(uneven, 2) == 1  # 1 class may be tiny
    assert IIDPartition().max_clients(ten, 11) == 0
    with pytest.raises(ValueError, match=r"classes_per_client must be an int in \[1, 2\]"):
        ShardsPartition(classes_per_client=3).max_clients(ten, 2)


@pytest.mark.parametrize("name", sorted(KINDS))
@pytest.mark.parametrize("min_size", [1, 2, 3])
def test_max_clients_is_reached_and_tight(name: str, min_size: int) -> None:
    kind = KINDS[name]
    rnd = random.Random(f"{name}{min_size}")
    for trial in range(6):
        labels = torch.randint(0, rnd.randint(2, 6), (rnd.randint(12, 80),), generator=gen(trial))
        limit = kind.max_clients(labels, min_size)

        parts = kind.partition(labels, limit, gen(trial), min_size=min_size)

        assert len(parts) == limit
        assert int(parts.sizes().min()) >= min_size
        if name != "classes":  # the classes bound is for the worst class order
            with pytest.raises(ValueError, match=f"at most {limit} clients"):
                kind.partition(labels, limit + 1, gen(trial), min_size=min_size)


# -- allow_overlap ------------------------------------------------------------------------------
def test_allow_overlap_is_a_documented_field_left_out_of_the_dump_at_its_default() -> None:
    field = PartitionConfig.model_fields["allow_overlap"]
    off = parse_config({"partition": {"kind": "iid"}})
    on = parse_config({"partition": {"kind": "iid", "allow_overlap": True}})

    assert field.default is False and field.description
    assert "allow_overlap" not in off.model_dump()["partition"]
    assert on.model_dump()["partition"]["allow_overlap"] is True
    assert parse_config(on.model_dump()) == on


@pytest.mark.parametrize("name", sorted(KINDS))
def test_overlap_gives_every_client_distinct_examples_each_held_by_every_group(name: str) -> None:
    labels = torch.arange(60) % 4
    kind = overlapping(KINDS[name])
    limit = kind.max_clients(labels, 2)
    num_clients = 3 * limit + 1  # 4 groups

    parts = kind.partition(labels, num_clients, gen(7), min_size=2)
    again = kind.partition(labels, num_clients, gen(7), min_size=2)

    assert len(parts) == num_clients
    assert int(parts.sizes().min()) >= 2
    assert all(p.unique().numel() == p.numel() for p in parts)  # no example twice in a client
    assert torch.bincount(parts.values, minlength=60).tolist() == [4] * 60
    assert torch.equal(parts.values, again.values) and torch.equal(parts.offsets, again.offsets)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_overlap_equals_the_plain_partition_when_the_data_suffice(name: str) -> None:
    labels = torch.arange(90) % 5
    kind = KINDS[name]
    n = kind.max_clients(labels, 2)

    plain = kind.split(labels, n, gen(3))
    shared = overlapping(kind).partition(labels, n, gen(3), min_size=2)

    assert len(shared) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, shared, strict=True))


def test_overlap_groups_are_the_kinds_own_split_in_turn() -> None:
    labels = torch.arange(30) % 3
    kind = overlapping(IIDPartition())  # at most 15 clients of 2: 40 clients are 3 groups
    g = gen(11)
    expected = [*kind.split(labels, 14, g), *kind.split(labels, 13, g), *kind.split(labels, 13, g)]

    parts = kind.partition(labels, 40, gen(11), min_size=2)

    assert all(torch.equal(a, b) for a, b in zip(expected, parts, strict=True))


def test_overlap_keeps_the_label_skew() -> None:
    # shards of one class each on balanced data: every client of every group holds one class
    labels = torch.arange(4).repeat_interleave(6)
    kind = overlapping(ShardsPartition(classes_per_client=1))

    parts = kind.partition(labels, 30, gen(0), min_size=2)

    assert all(labels[p].unique().numel() == 1 for p in parts)
    skewed = overlapping(DirichletPartition(alpha=0.05)).partition(labels, 40, gen(0))
    near_iid = overlapping(DirichletPartition(alpha=1000.0)).partition(labels, 40, gen(0))

    def top_share(ps: IndexParts) -> float:
        return sum(float(torch.bincount(labels[p]).max()) / p.numel() for p in ps) / len(ps)

    assert top_share(skewed) > top_share(near_iid) + 0.2


def test_overlap_fails_clearly_when_not_even_one_client_fits() -> None:
    with pytest.raises(ValueError, match="cannot give even one client 5 examples"):
        overlapping(IIDPartition()).partition(torch.arange(4), 3, gen(0), min_size=5)


def test_build_with_overlap_runs_the_fleet_of_the_issue() -> None:
    # the issue's case: digits and 1,000 clients, now with shared examples
    cfg = fleet_config(1000, {"kind": "dirichlet", "allow_overlap": True}, clients_per_round=10)
    exp = build(cfg)

    _, record = exp.simulation.step(exp.initial_state, 0)

    assert len(exp.clients) == 1000
    assert int(exp.clients.inner.sizes().min()) >= 1  # type: ignore[attr-defined]
    assert int(exp.clients.outer.sizes().min()) >= 1  # type: ignore[attr-defined]
    assert len(record.clients) == 10 and record.clients == sorted(record.clients)
    assert {e.client for e in record.ledger} == set(record.clients)


# -- packed parts -------------------------------------------------------------------------------
def test_index_parts_pack_index_iterate_and_concat() -> None:
    raw = [torch.tensor([4, 7]), torch.tensor([], dtype=torch.int64), torch.tensor([1, 2, 3])]

    parts = IndexParts.pack(raw)
    both = IndexParts.concat([parts, IndexParts.pack([torch.tensor([9])])])

    assert len(parts) == 3 and parts.sizes().tolist() == [2, 0, 3]
    assert [p.tolist() for p in parts] == [[4, 7], [], [1, 2, 3]]
    assert parts[-1].tolist() == [1, 2, 3] and [p.tolist() for p in parts[1:]] == [[], [1, 2, 3]]
    assert [p.tolist() for p in both] == [[4, 7], [], [1, 2, 3], [9]]
    assert parts[0].untyped_storage().nbytes() == 16  # a copy, not a view of all the parts
    with pytest.raises(IndexError, match="part 3 out of range for 3 parts"):
        parts[3]
    with pytest.raises(ValueError, match="offsets must rise from 0"):
        IndexParts(torch.arange(3), torch.tensor([0, 2]))


def test_split_parts_is_split_indices_on_every_part_bit_for_bit() -> None:
    rnd = random.Random(0)
    for trial in range(40):
        raw = [
            torch.randperm(50, generator=gen(100 * trial + i))[: rnd.randint(0, 12)]
            for i in range(rnd.randint(0, 25))
        ]
        fraction = rnd.choice([0.01, 0.3, 0.5, 0.7, 0.99])
        ours, theirs = gen(trial), gen(trial)

        inner, outer = split_parts(IndexParts.pack(raw), fraction, ours)
        expected = [split_indices(p, fraction, theirs) for p in raw]

        assert [(a.tolist(), b.tolist()) for a, b in expected] == [
            (a.tolist(), b.tolist()) for a, b in zip(inner, outer, strict=True)
        ]
        assert torch.equal(ours.get_state(), theirs.get_state())


def test_client_table_refuses_an_empty_outer_set() -> None:
    inner = IndexParts.pack([torch.tensor([0]), torch.tensor([1])])
    outer = IndexParts.pack([torch.tensor([2]), torch.tensor([], dtype=torch.int64)])

    with pytest.raises(ValueError, match="client 1: a client needs at least one inner and one"):
        ClientTable(inner, outer)


def test_index_parts_reads_each_part_as_a_copy_of_its_slice() -> None:
    """Parts read by index (the offsets read as numbers once, on the first read) are copies
    of their slices, for every index form, and never alias the packed values."""
    raw = [torch.tensor([5, 6]), torch.tensor([], dtype=torch.int64), torch.tensor([7, 8, 9])]
    parts = IndexParts.pack(raw)
    for _ in range(2):  # the first read makes the bounds, the second uses them
        assert [parts[i].tolist() for i in range(3)] == [[5, 6], [], [7, 8, 9]]
    assert parts[-1].tolist() == [7, 8, 9] and parts[torch.tensor(0).item()].tolist() == [5, 6]
    parts[2][0] = 0
    assert parts[2].tolist() == [7, 8, 9]
    with pytest.raises(IndexError, match="part 3 out of range for 3 parts"):
        parts[3]
    with pytest.raises(TypeError, match="an index must be an int or a slice"):
        parts[1.0]  # type: ignore[call-overload]


# -- shared budgets and the availability draw ---------------------------------------------------
def test_budgets_are_computed_once_per_distinct_device() -> None:
    model = MLPConfig(hidden=[8]).build((4,), 2)
    planner = BudgetPlanner(StructurePlan(model, model.example_input(1)), 4)
    catalog = load_catalog()
    pi, phone = catalog["raspberry_pi_4"], catalog["phone_low"]
    profiles = [pi, phone, pi.model_copy(), phone, pi]  # an equal copy shares too

    budgets = planner.budgets(profiles, 5.0)

    assert budgets == [planner.budget(p, 5.0) for p in profiles]
    assert len({id(b) for b in budgets}) == 2


def test_availability_draw_is_the_per_client_draw_of_before() -> None:
    exp = build(fleet_config(300, {"kind": "iid"}, clients_per_round=20))
    sim = exp.simulation
    profiles = list(exp.fleet)  # type: ignore[arg-type]

    for q in range(5):
        draws = torch.rand(
            300, generator=generator(sim.seed, q, Stream.AVAILABILITY), dtype=torch.float64
        )
        before = [c for c in range(300) if float(draws[c]) < profiles[c].availability]

        available = sim.available_clients(q)

        assert available == before
        assert sim.participation.unavailable(available) == sorted(set(range(300)) - set(before))


# -- 100,000 clients ----------------------------------------------------------------------------
def test_a_fleet_of_100000_clients_builds_and_runs_a_round_holding_little_per_client() -> None:
    n = 100_000
    exp = build(fleet_config(n, {"kind": "iid", "allow_overlap": True}, clients_per_round=100))
    sim = exp.simulation

    _, record = sim.step(exp.initial_state, 0)

    clients = exp.clients
    assert isinstance(clients, ClientTable) and len(clients) == n
    # two flat index tensors for all clients: 140 groups (719 clients at most) of 1,438
    # examples, 2 or 3 examples a client, one of them outer
    assert clients.inner.values.numel() + clients.outer.values.numel() == 140 * 1438
    assert clients.outer.sizes().unique().tolist() == [1]
    assert clients.inner.sizes().unique().tolist() == [1, 2]
    assert clients[n - 1].inner.numel() == clients[n - 1].outer.numel() == 1
    # 4 catalog devices: 4 device budgets shared by all clients; without masks every client
    # budget is (r = 1, the algorithm's steps): one object
    assert exp.device_budgets is not None and len(exp.device_budgets) == n
    assert len({id(b) for b in exp.device_budgets}) == 4
    assert len(sim.budgets) == n and len({id(b) for b in sim.budgets}) == 1
    # availability: one float64 tensor, no per-client objects; 100 clients took part
    assert sim.participation.availabilities().shape == (n,)
    assert len(record.clients) == 100
    assert len(record.clients) + len(record.unavailable) <= n
    assert not set(record.clients) & set(record.unavailable)
    assert {e.client for e in record.ledger} == set(record.clients)
