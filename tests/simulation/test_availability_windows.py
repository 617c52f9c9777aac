"""Availability windows on the virtual clock (issue 14, item 4).

A device profile's ``windows = [[start_s, end_s], ...]`` repeat every ``period_s`` simulated
seconds; the engine samples a client only when a window covers the round's start, then draws
its per-round availability as before. Hand-made cases, the engine on a toy algorithm with an
exact clock and on a short RABO run, FedScale-style behaviour traces, validation errors, the
fleet table's shares, and runs without windows bitwise equal to the engine before windows.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from radbo.cli import main as cli_main
from radbo.client import ClientBudget, ClientResult, ClientRuntime, ClientTask, CostRecord, Phase
from radbo.config import ConfigError, parse_config
from radbo.devices import Fleet, ProfileError, get_device, parse_profile
from radbo.devices.fleet import WindowSchedule
from radbo.devices.profile import DAY_S, window_covers, window_share
from radbo.experiment import build, fleet_table
from radbo.problem import ClientData
from radbo.randomness import Stream, generator
from radbo.simulation.engine import Simulation
from tests.configs import demo_dict


def profile(**fields: Any):
    record = {
        "name": "toy",
        "compute_flops": 1.0,
        "memory_bytes": 2**20,
        "uplink_bps": 1.0,
        "downlink_bps": 1.0,
        **fields,
    }
    return parse_profile(record)


# -- hand-made cases ------------------------------------------------------------------------
def test_window_0_100_with_period_200_hand_cases() -> None:
    device = profile(windows=[[0, 100]], period_s=200.0)

    at = {t: device.available_at(t) for t in (0.0, 50.0, 99.5, 100.0, 150.0, 200.0, 250.0, 350.0)}

    assert at == {
        0.0: True,
        50.0: True,
        99.5: True,
        100.0: False,  # a window is half-open: [start, end)
        150.0: False,
        200.0: True,  # the next period
        250.0: True,
        350.0: False,
    }
    assert device.windows == ((0.0, 100.0),)
    assert (device.window_share, device.available_share) == (0.5, 0.5)


def test_defaults_mean_always_on_and_a_daily_period() -> None:
    device = profile(availability=0.25)

    assert (device.windows, device.period_s) == ((), DAY_S)
    assert all(device.available_at(t) for t in (0.0, 43200.0, 1e9))
    assert (device.window_share, device.available_share) == (1.0, 0.25)


def test_night_charging_pattern_and_shares() -> None:
    # on while charging, 22:00 to 06:00 every day: two windows across the period's end
    night = profile(windows=[[79200, 86400], [0, 21600]], availability=0.5)

    days = [d * 86400.0 for d in range(3)]

    assert night.windows == ((0.0, 21600.0), (79200.0, 86400.0))  # kept sorted
    assert [night.available_at(d + h * 3600.0) for d in days for h in (1, 12, 23)] == [
        True,
        False,
        True,
    ] * 3
    assert night.window_share == 28800.0 / 86400.0
    assert night.available_share == (28800.0 / 86400.0) * 0.5
    assert window_share(((0.0, 100.0),), 200.0) == 0.5
    assert window_covers((), 5.0, 123.0) is True


def test_schedule_agrees_with_each_profile() -> None:
    profiles = [
        profile(windows=[[0, 100]], period_s=200.0),
        profile(),
        profile(windows=[[10, 20], [30, 40.5]], period_s=50.0),
        profile(windows=[[0, 0.1]], period_s=0.3),
    ]
    schedule = WindowSchedule.of(profiles)
    assert schedule is not None
    times = [0.0, 0.1, 0.2, 0.3, 10.0, 20.0, 40.49, 40.5, 150.0, 199.99, 1e6 + 0.05, 12345.6789]

    for t in times:
        assert schedule.open(t).tolist() == [p.available_at(t) for p in profiles], t
    assert WindowSchedule.of([profile(), profile()]) is None


def test_next_opening_is_the_earliest_window_start() -> None:
    schedule = WindowSchedule.of(
        [profile(windows=[[50, 60]], period_s=100.0), profile(windows=[[70, 75]], period_s=80.0)]
    )
    assert schedule is not None

    assert schedule.next_opening(0.0) == 50.0
    assert schedule.next_opening(55.0) == 55.0  # open now
    assert schedule.next_opening(61.0) == 70.0
    assert schedule.next_opening(76.0) == 150.0  # client 1 reopens at 150 (= 80 + 70) too


# -- the engine -----------------------------------------------------------------------------
@dataclass
class FixedWork:
    """One phase; every client reports ``flops`` FLOPs and sends nothing, so a round lasts
    ``flops / compute_flops`` simulated seconds exactly."""

    flops: int = 30
    name: str = "fixed"

    def init(self, x, y, buffers):
        return {"w": torch.zeros(1)}

    def model_state(self, state):
        return state

    def phases(self) -> Sequence[Phase]:
        return (Phase("only", self.broadcast, self.client, self.server),)

    def broadcast(self, state, index_set, slot=0):
        return {}

    def client(self, runtime: ClientRuntime, task: ClientTask) -> ClientResult:
        return ClientResult(task.client, {}, CostRecord(flops=self.flops))

    def server(self, state, results, index_sets, weights):
        return {"w": state["w"] + len(results)}, {}


def fixed_simulation(profiles: Sequence[Any]) -> Simulation:
    n = len(profiles)
    return Simulation(
        algorithm=FixedWork(),
        runtime=ClientRuntime(problem=None, features=None, labels=None, model=nn.Identity()),  # type: ignore[arg-type]
        clients=[ClientData(torch.tensor([0]), torch.tensor([1])) for _ in range(n)],
        budgets=[ClientBudget() for _ in range(n)],
        shapes={"w": torch.Size([1])},
        profiles=profiles,
        flop_meter=None,
    )


def test_engine_samples_clients_only_inside_their_windows_hand_computed() -> None:
    profiles = [
        profile(windows=[[0, 50]], period_s=100.0),
        profile(windows=[[50, 100]], period_s=100.0),
        profile(),  # always on: every round lasts 30 s
        profile(windows=[[20, 40], [80, 90]], period_s=100.0),
    ]
    sim = fixed_simulation(profiles)

    records = [r for _, r in sim.iterate(sim.algorithm.init({}, {}, {}), rounds=8)]

    starts = [0.0] + [r.clock_s for r in records[:-1]]
    assert starts == [0.0, 30.0, 60.0, 90.0, 120.0, 150.0, 180.0, 210.0]
    assert [r.clients for r in records] == [
        [0, 2],  # 0
        [0, 2, 3],  # 30: client 3's [20, 40)
        [1, 2],  # 60
        [1, 2],  # 90: client 3's [80, 90) is closed at 90
        [0, 2, 3],  # 120 -> phase 20
        [1, 2],  # 150 -> phase 50
        [1, 2, 3],  # 180 -> phase 80
        [0, 2],  # 210 -> phase 10
    ]
    assert [r.unavailable for r in records][:2] == [[1, 3], [1]]


def test_every_window_closed_waits_for_the_next_opening() -> None:
    sim = fixed_simulation([profile(windows=[[50, 60]], period_s=100.0)])

    records = [r for _, r in sim.iterate(sim.algorithm.init({}, {}, {}), rounds=5)]

    assert [r.clients for r in records] == [[], [0], [], [0], []]
    assert [r.round_time_s for r in records] == [50.0, 30.0, 70.0, 30.0, 70.0]
    assert [r.clock_s for r in records] == [50.0, 80.0, 150.0, 180.0, 250.0]
    assert records[0].unavailable == [0]


def test_windows_do_not_change_the_availability_draws() -> None:
    profiles = [profile(availability=0.5, windows=[[0, 50]], period_s=100.0) for _ in range(40)]
    sim = fixed_simulation(profiles)

    for q, t in [(0, 10.0), (1, 60.0), (2, 110.0)]:
        draws = torch.rand(
            40, generator=generator(sim.seed, q, Stream.AVAILABILITY), dtype=torch.float64
        )
        by_draw = [c for c in range(40) if float(draws[c]) < 0.5]

        available = sim.available_clients(q, t)

        assert available == (by_draw if t % 100.0 < 50.0 else [])


def fleet_file(tmp_path: Path, windows: list[Any] | None, period_s: float | None = None) -> Path:
    """Six catalog devices (the demo's tiers) as a fleet file; ``windows[i]`` for client i."""
    ids = ["laptop_cpu", "phone_mid", "raspberry_pi_4", "phone_low", "raspberry_pi_4", "phone_low"]
    profiles = []
    for i, device in enumerate(ids):
        update: dict[str, Any] = {}
        if windows is not None and windows[i] is not None:
            update["windows"] = tuple(tuple(float(t) for t in w) for w in windows[i])
            if period_s is not None:
                update["period_s"] = period_s
        profiles.append(parse_profile({**get_device(device).model_dump(), **update}))
    path = tmp_path / "fleet.toml"
    Fleet.from_profiles(profiles).to_file(path)
    return path


def small_run_config(path: Path, rounds: int) -> Any:
    data = demo_dict()
    data.update(
        rounds=rounds,
        eval_every=rounds,
        model={"name": "mlp", "hidden": [8]},
        algorithm={"name": "rabo", "inner_steps": 2, "batch_size": 4, "outer_batch_size": 4},
        estimator={"name": "cg", "max_iter": 2},
        baseline={"enabled": False},
    )
    data["fleet"] = {**data["fleet"], "num_clients": 6, "file": str(path)}
    del data["fleet"]["devices"]
    return parse_config(data)


def test_rabo_run_never_samples_a_client_outside_its_window(tmp_path: Path) -> None:
    # rounds last about 2.3 ms of simulated time: windows of 4.5 ms in a 9 ms cycle
    half = [[0.0, 0.0045]]
    other = [[0.0045, 0.009]]
    path = fleet_file(tmp_path, [None, half, other, half, other, half], period_s=0.009)
    exp = build(small_run_config(path, rounds=8))
    fleet = exp.fleet
    assert fleet is not None

    records = [r for _, r in exp.simulation.iterate(exp.initial_state, 8)]

    starts = [0.0] + [r.clock_s for r in records[:-1]]
    closed_seen = 0
    for start, r in zip(starts, records, strict=True):
        assert all(fleet[c].available_at(start) for c in r.clients)
        closed = [c for c in range(6) if not fleet[c].available_at(start)]
        assert set(closed) <= set(r.unavailable)
        closed_seen += len(closed)
    assert closed_seen > 0
    assert {c for r in records for c in r.clients} == set(range(6))


def test_run_without_windows_is_bitwise_the_engine_before_windows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run with the engine's availability as it was before windows (one draw per
    client against its probability; an empty round leaves the clock) and as it is now."""
    config = small_run_config(fleet_file(tmp_path, None), rounds=3)

    def run() -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
        exp = build(config)
        state, rows = exp.initial_state, []
        for state, record in exp.simulation.iterate(exp.initial_state, 3):  # noqa: B007
            rows.append({k: v for k, v in record.as_dict().items() if k != "wall_time_s"})
        return exp.simulation.algorithm.model_state(state), rows

    now_state, now_rows = run()

    def before(self: Simulation, round: int, clock_s: float = 0.0) -> list[int]:
        n = len(self.clients)
        assert self.profiles is not None
        draws = torch.rand(
            n, generator=generator(self.seed, round, Stream.AVAILABILITY), dtype=torch.float64
        )
        return [c for c in range(n) if float(draws[c]) < self.profiles[c].availability]

    monkeypatch.setattr(Simulation, "available_clients", before)
    monkeypatch.setattr(Simulation, "next_window_opening", lambda self, clock_s: clock_s)
    old_state, old_rows = run()

    assert now_rows == old_rows
    assert now_state.keys() == old_state.keys()
    assert all(torch.equal(now_state[k], old_state[k]) for k in now_state)


def test_always_open_windows_give_the_same_run(tmp_path: Path) -> None:
    plain = small_run_config(fleet_file(tmp_path / "a", None), rounds=2)
    full_day = small_run_config(fleet_file(tmp_path / "b", [[[0, 86400]]] * 6), rounds=2)

    runs = []
    for config in (plain, full_day):
        exp = build(config)
        out = list(exp.simulation.iterate(exp.initial_state, 2))
        runs.append((exp.simulation.algorithm.model_state(out[-1][0]), [r for _, r in out]))

    (a, ra), (b, rb) = runs
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [(r.clients, r.clock_s) for r in ra] == [(r.clients, r.clock_s) for r in rb]


# -- fleet files and traces -----------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_fleet_file_round_trips_windows_and_leaves_them_out_when_absent(
    tmp_path: Path, suffix: str
) -> None:
    windowed = profile(windows=[[0, 21600], [79200, 86400]], availability=0.5)
    hourly = profile(name="hourly", windows=[[0, 600.5]], period_s=3600.0)
    fleet = Fleet.from_profiles([windowed, hourly, profile(name="plain")])
    path = tmp_path / f"fleet{suffix}"

    fleet.to_file(path)
    text = path.read_text(encoding="utf-8")
    raw = json.loads(text) if suffix == ".json" else tomllib.loads(text)

    assert Fleet.from_file(path) == fleet
    assert raw["device"][0]["windows"] == [[0.0, 21600.0], [79200.0, 86400.0]]
    assert "period_s" not in raw["device"][0]  # the default, one day
    assert raw["device"][1]["period_s"] == 3600.0
    assert not {"windows", "period_s"} & set(raw["device"][2])


def write_traces(
    tmp_path: Path, behavior: dict[str, Any], suffix: str = ".json"
) -> tuple[Path, Path]:
    capacity = {"1": {"computation": 10.0, "communication": 1000.0}}
    capacity["2"] = {"computation": 20.0, "communication": 500.0}
    cap_path = tmp_path / "capacity.json"
    cap_path.write_text(json.dumps(capacity), encoding="utf-8")
    path = tmp_path / f"behavior{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(behavior), encoding="utf-8")
    else:
        lines = []
        for cid, entry in behavior.items():
            lines.append(f'["{cid}"]')
            lines += [f"{k} = {json.dumps(v)}" for k, v in entry.items()]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return cap_path, path


BEHAVIOR = {
    "1": {"duration": 300, "active": [0, 200], "inactive": [100, 250], "finish_time": 400},
    "2": {"active": [50], "inactive": [400], "finish_time": 400, "model": "Pixel"},
    "9": {"active": [1], "inactive": [2], "finish_time": 3},  # not in the capacity trace
}


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_trace_with_behavior_gives_per_client_windows(tmp_path: Path, suffix: str) -> None:
    cap, behavior = write_traces(tmp_path, BEHAVIOR, suffix)

    fleet = Fleet.from_trace(
        cap, flops_per_sample=1e6, memory_bytes=2**20, availability=0.5, behavior=behavior
    )

    assert [p.windows for p in fleet] == [((0.0, 100.0), (200.0, 250.0)), ((50.0, 400.0),)]
    assert [p.period_s for p in fleet] == [400.0, 400.0]
    assert [p.available_share for p in fleet] == [150.0 / 400.0 * 0.5, 350.0 / 400.0 * 0.5]
    assert [p.available_at(410.0) for p in fleet] == [True, False]
    assert fleet[0].compute_flops == 1e8  # the capacity trace as before
    assert all(p.windows == () for p in Fleet.from_trace(cap, flops_per_sample=1e6, memory_bytes=1))


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"active": [0], "inactive": [5]}, r"behavior\['1'\]\.finish_time = <missing>: Field"),
        (
            {"active": [0, 1], "inactive": [5], "finish_time": 9},
            "active has 2 times and inactive 1",
        ),
        ({"active": [], "inactive": [], "finish_time": 9}, r"behavior\['1'\]\.active = \[\]: "),
        ({"active": "0", "inactive": [5], "finish_time": 9}, r"\.active = '0': must be a list"),
        ({"active": [0], "inactive": [True], "finish_time": 9}, r"\.inactive = \[True\]: must"),
        ({"active": [0], "inactive": [5], "finish_time": math.nan}, r"\.finish_time = nan: must"),
        ({"active": [0], "inactive": [5], "finish_time": 9, "gpu": 1}, r"\.gpu = 1: unknown"),
        ({"active": [0, 3], "inactive": [5, 8], "finish_time": 9}, "trace client 1: windows = "),
        ({"active": [0], "inactive": [50], "finish_time": 9}, r"outside the period \[0, 9.0\]"),
    ],
)
def test_bad_behavior_entry_is_one_line_naming_client_and_field(
    tmp_path: Path, entry: dict[str, Any], expected: str
) -> None:
    cap, behavior = write_traces(tmp_path, {"1": entry, "2": BEHAVIOR["2"]})

    with pytest.raises(ProfileError, match=expected) as err:
        Fleet.from_trace(cap, flops_per_sample=1e6, memory_bytes=2**20, behavior=behavior)

    assert "\n" not in str(err.value)


def test_behavior_trace_missing_a_client_names_it(tmp_path: Path) -> None:
    cap, behavior = write_traces(tmp_path, {"1": BEHAVIOR["1"]})

    with pytest.raises(ProfileError, match=r"has no entry for client 2 of the capacity trace"):
        Fleet.from_trace(cap, flops_per_sample=1e6, memory_bytes=2**20, behavior=behavior)


def test_behavior_trace_is_read_from_json_or_toml_only(tmp_path: Path) -> None:
    cap, _ = write_traces(tmp_path, BEHAVIOR)
    pickled = tmp_path / "client_behave_trace.pkl"
    pickled.write_bytes(b"\x80\x04K\x01.")

    with pytest.raises(ProfileError, match="must end in .json or .toml"):
        Fleet.from_trace(cap, flops_per_sample=1e6, memory_bytes=2**20, behavior=pickled)


def test_config_trace_behavior_reaches_the_fleet(tmp_path: Path) -> None:
    cap, behavior = write_traces(tmp_path, BEHAVIOR)
    data = demo_dict()
    data["fleet"] = {
        "num_clients": 2,
        "trace": {
            "path": str(cap),
            "flops_per_sample": 1e6,
            "memory_bytes": 2**30,
            "behavior": str(behavior),
        },
    }
    config = parse_config(data)

    from radbo.experiment.build import build_fleet

    fleet = build_fleet(config.fleet, config.seed)

    assert fleet is not None and [p.period_s for p in fleet] == [400.0, 400.0]
    bad = {**data["fleet"]["trace"], "behavior": str(tmp_path / "missing.json")}
    with pytest.raises(ConfigError, match=r"config error: fleet.trace: .*missing.json does not"):
        build_fleet(parse_config({**data, "fleet": {**data["fleet"], "trace": bad}}).fleet, 0)


# -- validation -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"windows": [[100, 50]]}, r"windows = \[\[100, 50\]\]: window \[100.0, 50.0\] must end"),
        ({"windows": [[50, 50]]}, r"window \[50.0, 50.0\] must end after it starts"),
        ({"windows": [[0, 100], [50, 150]]}, r"windows \[0.0, 100.0\] and \[50.0, 150.0\] overlap"),
        ({"windows": [[150, 250]], "period_s": 200.0}, r"outside the period \[0, 200.0\]"),
        ({"windows": [[-10, 10]]}, r"window \[-10.0, 10.0\] lies outside the period"),
        ({"windows": [[0, math.nan]]}, r"windows\[0\]\[1\] = nan: Input should be a finite number"),
        ({"windows": [[math.inf, 1]]}, r"windows\[0\]\[0\] = inf: Input should be a finite"),
        ({"windows": [[0]]}, r"windows\[0\] = \[0\]: expected a pair \[start_s, end_s\]"),
        ({"windows": [[0, 1, 2]]}, r"windows\[0\] = \[0, 1, 2\]: expected a pair"),
        ({"windows": [["0", 1]]}, r"windows\[0\]\[0\] = '0': Input should be a valid number"),
        ({"windows": "night"}, r"windows = 'night': Input should be a list"),
        ({"period_s": 0.0}, r"period_s = 0.0: Input should be greater than 0"),
        ({"period_s": math.inf, "windows": [[0, 1]]}, r"period_s = inf: Input should be a finite"),
    ],
)
def test_bad_windows_are_one_line_naming_the_field(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(ProfileError, match=expected) as err:
        profile(**fields)

    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("device profile error: ")
    assert "(allowed: " in message


def test_windows_touching_at_an_end_are_allowed() -> None:
    device = profile(windows=[[100, 200], [0, 100]], period_s=200.0)

    assert device.windows == ((0.0, 100.0), (100.0, 200.0))
    assert device.window_share == 1.0


def test_nan_window_in_a_toml_fleet_file_names_the_client(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(
        "[[device]]\n"
        'name = "a"\ncompute_flops = 1.0\nmemory_bytes = 1\nuplink_bps = 1.0\n'
        "downlink_bps = 1.0\nwindows = [[0, nan]]\n",
        encoding="utf-8",
    )

    with pytest.raises(ProfileError, match=r"device\[0\]\.windows\[0\]\[1\] = nan: "):
        Fleet.from_file(path)


# -- the fleet table ------------------------------------------------------------------------
def test_fleet_table_and_cli_show_each_clients_share_of_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    windows = [None, [[0, 43200]], [[0, 21600], [64800, 86400]], None, [[0, 8640]], None]
    path = fleet_file(tmp_path, windows)
    config = small_run_config(path, rounds=1)
    fleet = Fleet.from_file(path)

    rows = fleet_table(config)

    assert [r["window_share"] for r in rows] == [1.0, 0.5, 0.5, 1.0, 0.1, 1.0]
    assert [r["available_share"] for r in rows] == [
        share * p.availability
        for share, p in zip([1.0, 0.5, 0.5, 1.0, 0.1, 1.0], fleet, strict=True)
    ]
    demo = (Path(__file__).resolve().parents[2] / "examples" / "demo.toml").read_text()
    devices = next(line for line in demo.splitlines() if line.startswith("devices = "))
    text = demo.replace(devices, f"file = {json.dumps(str(path))}").replace(
        "num_clients = 10", "num_clients = 6"
    )
    config_path = tmp_path / "run.toml"
    config_path.write_text(text, encoding="utf-8")

    assert cli_main(["fleet", str(config_path)]) == 0

    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-4:] == ["window", "t_avail", "round", "s"]
    cells = lines[2].split()  # client 1: half of each day, at a phone's availability
    assert cells[-3:-1] == [f"{0.5:.3f}", f"{0.5 * fleet[1].availability:.3f}"]
