"""Cost ledger: FLOPs, bytes, simulated time, availability, savings."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from radbo.client import ClientBudget, ClientResult, ClientRuntime, ClientTask, CostRecord, Phase
from radbo.config import ConfigError, load_config, parse_config
from radbo.cost import LedgerEntry, index_metadata_bytes, phase_times, round_time, totals
from radbo.devices.budget import DeviceTooSmallError
from radbo.experiment import build, fleet_table, run
from radbo.problem import ClientData
from radbo.simulation import Simulation
from tests.configs import DEMO, demo_dict, small_config


# -- pure functions -------------------------------------------------------------------------
def test_index_metadata_counts_each_distinct_list_once_as_int32():
    keep = torch.tensor([0, 2, 5])
    index_set = {
        "a.weight": (keep, None),
        "a.bias": (keep,),
        "b.weight": (None, keep),
        "c.weight": (torch.tensor([1]), None),
        "d.weight": (None, None),
    }

    assert index_metadata_bytes(index_set) == (3 + 1) * 4
    assert index_metadata_bytes({"w": (None, None)}) == 0


@dataclass(frozen=True)
class Device:
    name: str
    tier: str
    compute_flops: float
    uplink_bps: float
    downlink_bps: float
    availability: float = 1.0


def test_phase_times_hand_computed():
    dev = Device("d", "t", compute_flops=2e9, uplink_bps=1e6, downlink_bps=4e6)

    compute, comm = phase_times(flops=10**9, bytes_down=1000, bytes_up=500, profile=dev)

    assert compute == 0.5
    # Python float64 on both sides (no tensor kernels): a few roundings, ~1e-16 relative,
    # against approx's 1e-6
    assert comm == pytest.approx(8 * 1000 / 4e6 + 8 * 500 / 1e6)
    assert phase_times(10**9, 1000, 500, None) == (0.0, 0.0)


def _entry(phase: str, client: int, compute: float, comm: float) -> LedgerEntry:
    return LedgerEntry(0, phase, client, "t", 0, 0, 0, 0, 0, 0, compute, comm)


def test_round_time_is_sum_over_phases_of_slowest_client():
    entries = [
        _entry("inner", 0, 1.0, 0.5),
        _entry("inner", 1, 2.0, 0.25),
        _entry("outer", 0, 3.0, 0.0),
        _entry("outer", 1, 0.5, 0.5),
    ]

    assert round_time(entries) == 2.25 + 3.0


# -- engine with a hand-built 3-device fleet -------------------------------------------------
M = 16  # the client multiplies an M x M matrix by an M x M matrix: 2 M^3 FLOPs


@dataclass(frozen=True)
class MatmulAlgorithm:
    """One phase; the server sends an (M, M) float32 tensor, the client returns an (M,) one."""

    name: str = "matmul"

    def init(self, x, y, buffers):
        return {"w": torch.ones(M, M)}

    def model_state(self, state):
        return state

    def phases(self) -> Sequence[Phase]:
        return (Phase("only", self.broadcast, self.client, self.server),)

    def broadcast(self, state, index_set, slot=0):
        return {"w": state["w"].clone()}

    def client(self, runtime: ClientRuntime, task: ClientTask) -> ClientResult:
        w = task.params["w"]
        out = (w @ w).sum(0)
        return ClientResult(
            task.client, {"u": out}, CostRecord(bytes_down=M * M * 4, bytes_up=M * 4)
        )

    def server(self, state, results, index_sets, weights):
        return state, {"n": float(len(results))}


def _matmul_simulation(devices):
    n = len(devices)
    return Simulation(
        algorithm=MatmulAlgorithm(),
        runtime=ClientRuntime(problem=None, features=None, labels=None, model=nn.Identity()),
        clients=[ClientData(torch.tensor([0]), torch.tensor([1])) for _ in range(n)],
        budgets=[ClientBudget() for _ in range(n)],
        shapes={"w": torch.Size([M, M])},
        profiles=devices,
    )


def test_three_device_virtual_clock_hand_computed():
    devices = [
        Device("slow", "a", compute_flops=1e6, uplink_bps=1e5, downlink_bps=1e6),
        Device("mid", "b", compute_flops=4e6, uplink_bps=1e6, downlink_bps=1e6),
        Device("fast", "c", compute_flops=1e9, uplink_bps=1e3, downlink_bps=1e9),
    ]
    sim = _matmul_simulation(devices)
    flops = 2 * M**3
    down, up = 8 * M * M * 4, 8 * M * 4
    expected = [
        flops / d.compute_flops + down / d.downlink_bps + up / d.uplink_bps for d in devices
    ]

    records = [r for _, r in sim.iterate(sim.algorithm.init({}, {}, {}), rounds=2)]

    assert [e.flops for e in records[0].ledger] == [flops] * 3
    # simulated times: Python float64 formulas of integer FLOPs and bytes (no tensor kernels),
    # a few roundings (~1e-16 relative) against approx's 1e-6
    assert [e.time_s for e in records[0].ledger] == pytest.approx(expected)
    assert records[0].round_time_s == pytest.approx(max(expected))
    assert records[1].clock_s == pytest.approx(2 * max(expected))
    assert [e.tier for e in records[0].ledger] == ["a", "b", "c"]
    assert sim.flop_meter.measurements == 1  # one workload, measured once


def test_unavailable_client_is_excluded_and_counted():
    devices = [
        Device("on", "a", 1e6, 1e6, 1e6, availability=1.0),
        Device("off", "b", 1e6, 1e6, 1e6, availability=0.0),
        Device("on2", "a", 1e6, 1e6, 1e6, availability=1.0),
    ]
    sim = _matmul_simulation(devices)

    records = [r for _, r in sim.iterate(sim.algorithm.init({}, {}, {}), rounds=3)]

    for r in records:
        assert r.clients == [0, 2]
        assert r.unavailable == [1]
        assert {e.client for e in r.ledger} == {0, 2}


def test_availability_draws_are_seeded_and_near_the_probability():
    devices = [Device(f"d{i}", "a", 1e6, 1e6, 1e6, availability=0.3) for i in range(50)]
    sim = _matmul_simulation(devices)

    counts = [len(sim.available_clients(q)) for q in range(40)]

    assert counts == [len(sim.available_clients(q)) for q in range(40)]
    # seeded uniform draws (the same bits under every kernel): 0.3 +- 0.05 is 4.9 binomial sd
    # of 2,000 draws
    assert 0.25 < sum(counts) / (40 * 50) < 0.35


# -- RABO ledger on the digits MLP ---------------------------------------------------------
def _first_round(**overrides):
    cfg = small_config(rounds=1, mask={"policy": "leading"}, **overrides)
    exp = build(cfg)
    _, record = next(exp.simulation.iterate(exp.initial_state, 1))
    return cfg, exp, record


def test_inner_phase_flops_equal_the_analytic_count():
    """Per sample: hidden layer forward 2*64*h, head forward 2*h*10, head weight gradient
    2*h*10; no gradient flows into x in the inner phase (FlopCounterMode skips ReLU, the
    L2 term and the cross-entropy)."""
    h = 128
    cfg, _, record = _first_round(model={"name": "mlp", "hidden": [h]}, fleet={"capacities": [1.0]})

    for e in record.ledger:
        if e.phase == "train.inner":
            assert e.flops == e.samples * (2 * 64 * h + 2 * h * 10 + 2 * h * 10)


def test_bytes_are_the_tensors_on_the_wire_and_quarter_capacity_sends_a_quarter_of_x():
    h = 128
    cfg, exp, record = _first_round(
        model={"name": "mlp", "hidden": [h]},
        fleet={"num_clients": 2, "capacities": [1.0, 0.25]},
    )
    outer = {e.client: e for e in record.ledger if e.phase == "train.outer"}
    inner = {e.client: e for e in record.ledger if e.phase == "train.inner"}
    x_full = (h * 64 + h) * 4
    y_full = (10 * h + 10) * 4
    k = h // 4
    y_quarter = (10 * k + 10) * 4

    # outer phase: y down, hypergradient of x up
    assert outer[0].bytes_up == x_full
    assert outer[1].bytes_up == (k * 64 + k) * 4
    assert outer[1].bytes_up / outer[0].bytes_up == 0.25
    assert outer[0].bytes_down == y_full and outer[1].bytes_down == y_quarter
    # inner phase: x, y and the kept-index metadata down, G (y-sized) up
    assert inner[0].bytes_down == x_full + y_full
    assert inner[1].bytes_down == (k * 64 + k) * 4 + y_quarter + k * 4
    assert inner[0].bytes_up == y_full and inner[1].bytes_up == y_quarter


def test_run_reports_totals_tiers_and_savings_against_full_model_baseline():
    data = demo_dict()
    data.update(rounds=2, eval_every=2, baseline={"enabled": True})

    result = run(parse_config(data), progress=False, save=False)

    assert set(result.totals_by_tier) == {"laptop", "phone-low", "phone-mid", "sbc"}
    tier_flops = sum(t["flops"] for t in result.totals_by_tier.values())
    assert tier_flops == result.totals["flops"]
    assert result.totals["sim_time_s"] > 0
    sv = result.savings
    assert 0 < sv["compute_fraction"] < 1
    assert 0 < sv["bytes_fraction"] < 1
    assert 0 < sv["time_fraction"] <= 1
    assert result.baseline.totals["communication_rounds"] == result.totals["communication_rounds"]
    assert totals([])["flops"] == 0
    # the baseline trains full models everywhere: every client of ours does at most its work
    assert result.totals["bytes_up"] < result.baseline.totals["bytes_up"]


def test_capacity_from_memory_budget_and_too_small_device(tmp_path):
    """Without explicit capacities r is the largest level whose training memory fits; a device
    that fits nothing stops the run with a clear error (exit code 2 on the command line)."""
    from radbo.cli import main
    from radbo.devices import Fleet, get_device

    probe_cfg = small_config(fleet={"devices": {"laptop_cpu": 1.0}, "capacities": None})
    planner = build(probe_cfg).planner
    between = (planner.memory_at(0.25).total + planner.memory_at(0.5).total) // 2
    base = get_device("laptop_cpu")
    roomy = base.model_copy(update={"name": "roomy", "tier": "big"})
    tight = base.model_copy(update={"name": "tight", "tier": "small", "memory_bytes": between})
    tiny = base.model_copy(update={"name": "tiny", "tier": "tiny", "memory_bytes": 1000})
    fleet_file = tmp_path / "fleet.toml"
    Fleet.from_profiles([roomy, tight] * 5).to_file(fleet_file)

    cfg = small_config(fleet={"file": str(fleet_file), "capacities": None, "devices": None})
    budgets = build(cfg).simulation.budgets

    assert [b.capacity for b in budgets] == [1.0, 0.25] * 5

    Fleet.from_profiles([roomy, tiny] * 5).to_file(fleet_file)
    config_file = tmp_path / "run.toml"
    text = (Path(__file__).resolve().parents[1] / "examples" / "demo.toml").read_text()
    text = text.replace(
        "capacities = { laptop = 1.0, phone-mid = 1.0, sbc = 0.5, phone-low = 0.25 }", ""
    ).replace(
        "devices = { laptop_cpu = 0.2, phone_mid = 0.2, raspberry_pi_4 = 0.3, phone_low = 0.3 }",
        f'file = "{fleet_file}"',
    )
    config_file.write_text(text)
    with pytest.raises(
        DeviceTooSmallError, match="client 1: device cannot train even the smallest"
    ):
        build(load_config(config_file))
    assert main(["fleet", str(config_file)]) == 2


def test_fleet_command_prints_one_row_per_client(capsys):
    from radbo.cli import main

    assert main(["fleet", str(DEMO)]) == 0

    lines = capsys.readouterr().out.strip().splitlines()
    # a header, a row per client, then one footnote per device the rows name by [k]
    assert lines[0].split()[:4] == ["client", "device", "tier", "r"]
    assert [line.split()[0] for line in lines[1:11]] == [str(i) for i in range(10)]
    assert [line.split()[0] for line in lines[11:]] == ["[1]", "[2]", "[3]", "[4]"]
    rows = fleet_table(load_config(DEMO))
    assert sorted(r["capacity"] for r in rows) == [0.25] * 3 + [0.5] * 3 + [1.0] * 4
    assert all(r["memory_fits"] for r in rows)
    assert all(r["round_time_s"] > 0 for r in rows)


def test_capacities_by_tier_need_every_tier():
    with pytest.raises(ConfigError, match="no capacity for device tier"):
        build(small_config(fleet={"capacities": {"laptop": 1.0}}))
    with pytest.raises(ConfigError, match="capacities by device tier needs devices"):
        small_config(fleet={"devices": None, "capacities": {"laptop": 1.0}})
