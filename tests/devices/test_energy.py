"""Energy: device profiles' J/FLOP and radio J/byte, the ledger's joules per client phase,
totals per tier and run in results.json, savings, ``radbo report``'s energy plot, checkpoint rows.

Energies are compared exactly (float64, the ledger's formula in the ledger's order), never
with a tolerance."""

import json
import math
import re
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from radbo.config import parse_config
from radbo.cost import (
    LedgerEntry,
    LedgerRow,
    as_dicts,
    phase_energy,
    savings,
    totals,
    totals_by_tier,
)
from radbo.devices import get_device, load_catalog
from radbo.devices.fleet import Fleet
from radbo.devices.profile import ProfileError, parse_profile
from radbo.experiment import run
from radbo.experiment.build import build_fleet
from radbo.report import PLOTS, compare, load_run
from tests.configs import demo_dict

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: the demo's device tiers and the catalog ids they come from (examples/demo.toml [fleet])
DEMO_TIERS = {
    "laptop": "laptop_cpu",
    "phone-mid": "phone_mid",
    "sbc": "raspberry_pi_4",
    "phone-low": "phone_low",
}
ENERGY_TOTALS = (
    "energy_compute_j",
    "energy_radio_j",
    "energy_j",
    "energy_unpriced_flops",
    "energy_unpriced_bytes",
)


def compute_j(row: dict, profile) -> float:
    """FLOPs x J/FLOP, by hand."""
    return row["flops"] * profile.energy_per_flop


def radio_j(row: dict, profile) -> float:
    """bytes up x J/byte up + bytes down x J/byte down, by hand (the documented order)."""
    return row["bytes_up"] * profile.energy_per_byte_up + row["bytes_down"] * (
        profile.energy_per_byte_down
    )


def summed(values) -> float:
    """Left-to-right sum from 0, the order in which the ledger totals add rows up."""
    total = 0
    for v in values:
        total += v
    return float(total)


# -- the demo, end to end -------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two rounds of examples/demo.toml (with its full-model baseline) through ``radbo.run``,
    saved: the parsed results.json and ledger.json."""
    out = tmp_path_factory.mktemp("demo")
    data = demo_dict()
    data.update(rounds=2, eval_every=1, output_dir=str(out))
    run(parse_config(data), progress=False, save=True)
    return {
        "dir": out,
        "results": json.loads((out / "results.json").read_text()),
        "ledger": json.loads((out / "ledger.json").read_text()),
    }


def test_one_clients_ledger_rows_are_flops_and_bytes_priced_by_its_profile(demo: dict) -> None:
    # Arrange: the first client in the ledger, and its catalog profile
    ledger = demo["ledger"]
    client = ledger[0]["client"]
    rows = [r for r in ledger if r["client"] == client]
    profile = get_device(DEMO_TIERS[rows[0]["tier"]])
    assert profile.tier == rows[0]["tier"]

    # Assert: every phase of every round, exactly
    assert len(rows) >= 2
    for row in rows:
        assert row["energy_compute_j"] == compute_j(row, profile)
        assert row["energy_radio_j"] == radio_j(row, profile)
        assert row["energy_compute_j"] > 0 and row["energy_radio_j"] > 0


def test_results_json_has_energy_totals_per_tier_equal_to_hand_computed_sums(demo: dict) -> None:
    results, ledger = demo["results"], demo["ledger"]
    by_tier = results["totals_by_tier"]

    assert set(by_tier) == set(DEMO_TIERS)
    for tier, catalog_id in DEMO_TIERS.items():
        profile = get_device(catalog_id)
        rows = [r for r in ledger if r["tier"] == tier]  # ledger order
        expected_compute = summed(compute_j(r, profile) for r in rows)
        expected_radio = summed(radio_j(r, profile) for r in rows)

        t = by_tier[tier]
        assert t["energy_compute_j"] == expected_compute, tier
        assert t["energy_radio_j"] == expected_radio, tier
        assert t["energy_j"] == expected_compute + expected_radio, tier
        assert t["energy_unpriced_flops"] == 0 and t["energy_unpriced_bytes"] == 0
        assert t["energy_j"] > 0
    # the run totals: every row, in ledger order
    run_totals = results["totals"]
    assert run_totals["energy_compute_j"] == summed(r["energy_compute_j"] for r in ledger)
    assert run_totals["energy_radio_j"] == summed(r["energy_radio_j"] for r in ledger)
    assert run_totals["energy_j"] == run_totals["energy_compute_j"] + run_totals["energy_radio_j"]
    assert all(key in results["baseline"]["totals"] for key in ENERGY_TOTALS)


def test_each_round_carries_its_energy_cost(demo: dict) -> None:
    results, ledger = demo["results"], demo["ledger"]

    for record in results["rounds"]:
        rows = [r for r in ledger if r["round"] == record["round"]]
        assert record["cost_energy_compute_j"] == summed(r["energy_compute_j"] for r in rows)
        assert record["cost_energy_radio_j"] == summed(r["energy_radio_j"] for r in rows)
        assert record["cost_energy_unpriced_flops"] == 0


def test_savings_include_energy_fractions_of_the_baseline(demo: dict) -> None:
    results = demo["results"]
    mine, base = results["totals"], results["baseline"]["totals"]
    sv = results["savings"]

    assert sv["energy_fraction"] == mine["energy_j"] / base["energy_j"]
    assert sv["energy_compute_fraction"] == mine["energy_compute_j"] / base["energy_compute_j"]
    assert sv["energy_radio_fraction"] == mine["energy_radio_j"] / base["energy_radio_j"]
    # the masked run trains submodels on part of the fleet: less work than the full model
    assert 0 < sv["energy_compute_fraction"] < 1


def test_report_plots_accuracy_against_energy_and_lists_energy(demo: dict, tmp_path: Path) -> None:
    # Act
    result = compare([demo["dir"]], tmp_path / "report")

    # Assert: the PNG beside the other plots
    energy_png = tmp_path / "report" / "accuracy_vs_energy.png"
    assert "accuracy_vs_energy.png" in PLOTS
    assert energy_png in result.plots
    assert energy_png.read_bytes()[:8] == PNG_SIGNATURE
    # report.json: the energy totals unrounded, per run and per tier, and the curve
    entry = json.loads(result.json.read_text())["runs"][0]
    totals_ = demo["results"]["totals"]
    assert entry["energy_j"] == totals_["energy_j"]
    assert entry["energy_compute_j"] == totals_["energy_compute_j"]
    assert entry["energy_radio_j"] == totals_["energy_radio_j"]
    assert {t["tier"]: t["energy_j"] for t in entry["tiers"]} == {
        tier: t["energy_j"] for tier, t in demo["results"]["totals_by_tier"].items()
    }
    curve = entry["curve"]["cumulative_energy_j"]
    assert curve == [
        summed(r["cost_energy_j"] for r in demo["results"]["rounds"][: i + 1])
        for i in range(len(curve))
    ]
    # report.md: an energy column in the main table (with "energy vs base") and tier tables
    markdown = result.markdown.read_text()
    assert "| energy (J) |" in result.table and "energy vs base" in result.table
    assert f"{totals_['energy_j']:.3g}" in result.table
    assert markdown.count("energy share") == 1
    assert "![accuracy_vs_energy.png](accuracy_vs_energy.png)" in markdown


@pytest.mark.parametrize("kind", ["written before energy", "nothing priced"])
def test_report_shows_unknown_energy_as_dashes_not_zero(
    demo: dict, tmp_path: Path, kind: str
) -> None:
    """A results.json without energy keys (written before radbo accounted energy), or one whose
    fleet had no energy figures at all (0 J with unpriced work): unknown, so "-" and no line."""
    # Arrange
    folder = tmp_path / "run"
    folder.mkdir()
    results = json.loads(json.dumps(demo["results"]))
    sections = [(results["totals"], ""), *((t, "") for t in results["totals_by_tier"].values())]
    sections += [(row, "cost_") for row in results["rounds"]]
    for section, prefix in sections:
        for key in ENERGY_TOTALS:
            if kind == "written before energy":
                del section[prefix + key]
            elif key.startswith("energy_unpriced"):
                section[prefix + key] = 1
            else:
                section[prefix + key] = 0.0
    del results["baseline"], results["savings"]
    (folder / "results.json").write_text(json.dumps(results))

    # Act
    result = compare([load_run(folder)], tmp_path / "report")

    # Assert
    entry = result.data["runs"][0]
    assert entry["energy_j"] is None
    assert all(t["energy_j"] is None and t["energy_share"] is None for t in entry["tiers"])
    assert entry["curve"]["cumulative_energy_j"] == [None] * len(results["rounds"])
    # no run has energy: the plot is not written, and the report says why (issue 27)
    assert not (tmp_path / "report" / "accuracy_vs_energy.png").exists()
    assert any(n.startswith("accuracy_vs_energy: not drawn") for n in result.notes)
    header, _, cells = (
        [c.strip() for c in line.strip("|").split("|")] for line in result.table.splitlines()
    )
    assert cells[header.index("energy (J)")] == "-"


# -- profiles without energy figures ----------------------------------------------------------
def test_a_device_without_energy_figures_is_unpriced_not_free(tmp_path: Path) -> None:
    """The demo's fleet with its phone-low devices stripped of energy figures: their ledger
    rows hold null (unknown), and the totals count their FLOPs and bytes as unpriced."""
    # Arrange
    data = demo_dict()
    data.update(rounds=1, eval_every=1, output_dir=str(tmp_path / "run"))
    data["baseline"] = {"enabled": False}
    unknown = dict.fromkeys(("energy_per_flop", "energy_per_byte_up", "energy_per_byte_down"))
    config = parse_config(data)
    fleet = build_fleet(config.fleet, config.seed)
    assert fleet is not None
    stripped = [p.model_copy(update=unknown) if p.tier == "phone-low" else p for p in fleet]
    Fleet.from_profiles(stripped).to_file(tmp_path / "fleet.toml")
    del data["fleet"]["devices"]
    data["fleet"]["file"] = str(tmp_path / "fleet.toml")

    # Act
    run(parse_config(data), progress=False, save=True)
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())

    # Assert
    low = [r for r in ledger if r["tier"] == "phone-low"]
    priced = [r for r in ledger if r["tier"] != "phone-low"]
    assert low and priced
    assert all(r["energy_compute_j"] is None and r["energy_radio_j"] is None for r in low)
    t = results["totals"]
    assert t["energy_unpriced_flops"] == sum(r["flops"] for r in low)
    assert t["energy_unpriced_bytes"] == sum(r["bytes_down"] + r["bytes_up"] for r in low)
    assert t["energy_compute_j"] == summed(r["energy_compute_j"] for r in priced)
    assert t["energy_radio_j"] == summed(r["energy_radio_j"] for r in priced)
    tier = results["totals_by_tier"]["phone-low"]
    assert (tier["energy_j"], tier["energy_compute_j"], tier["energy_radio_j"]) == (0.0, 0.0, 0.0)
    assert tier["energy_unpriced_flops"] == t["energy_unpriced_flops"] > 0
    # the report marks the partial total
    report = compare([tmp_path / "run"], tmp_path / "report")
    assert ">=" in report.table
    low_row = next(r for r in report.tiers[report.labels[0]] if r["tier"] == "phone-low")
    assert low_row["energy_unpriced_bytes"] == tier["energy_unpriced_bytes"]


def entry(flops: int, down: int, up: int, compute: float | None, radio: float | None, tier="a"):
    return LedgerEntry(0, "p", 0, tier, flops, 0, 0, 0, down, up, 0.0, 0.0, compute, radio)


def test_totals_sum_known_joules_and_count_what_is_unpriced() -> None:
    entries = [
        entry(10, 4, 2, 0.5, 0.25),
        entry(7, 3, 1, None, 0.125, tier="b"),
        entry(5, 8, 16, 0.25, None, tier="b"),
        entry(1, 1, 1, None, None),
    ]

    t = totals(entries)
    by_tier = totals_by_tier(entries)

    assert (t["energy_compute_j"], t["energy_radio_j"], t["energy_j"]) == (0.75, 0.375, 1.125)
    assert (t["energy_unpriced_flops"], t["energy_unpriced_bytes"]) == (7 + 1, 8 + 16 + 2)
    assert by_tier["b"]["energy_j"] == 0.375 and by_tier["b"]["energy_unpriced_bytes"] == 24
    assert totals([])["energy_j"] == 0.0 and totals([])["energy_unpriced_flops"] == 0
    assert as_dicts(entries[:1])[0]["energy_radio_j"] == 0.25


def test_phase_energy_is_the_documented_formula_and_none_when_unknown() -> None:
    profile = get_device("raspberry_pi_4")
    no_energy = profile.model_copy(
        update=dict.fromkeys(("energy_per_flop", "energy_per_byte_up", "energy_per_byte_down"))
    )

    compute, radio = phase_energy(1_234_567, 8_000, 2_000, profile)

    assert compute == 1_234_567 * profile.energy_per_flop
    assert radio == 2_000 * profile.energy_per_byte_up + 8_000 * profile.energy_per_byte_down
    assert phase_energy(1_234_567, 8_000, 2_000, no_energy) == (None, None)
    assert phase_energy(1_234_567, 8_000, 2_000, None) == (None, None)
    only_compute = profile.model_copy(
        update={"energy_per_byte_up": None, "energy_per_byte_down": None}
    )
    assert phase_energy(4, 1, 1, only_compute) == (4 * profile.energy_per_flop, None)


def test_savings_energy_fraction_is_nan_without_a_baseline_figure() -> None:
    run_totals = {"flops": 2, "bytes": 2, "sim_time_s": 1.0, "energy_j": 0.5}

    sv = savings(run_totals, {"flops": 4, "bytes": 4, "sim_time_s": 2.0, "energy_j": 2.0})
    missing = savings(run_totals, {"flops": 4, "bytes": 4, "sim_time_s": 2.0})

    assert sv["energy_fraction"] == 0.25
    assert math.isnan(missing["energy_fraction"]) and missing["compute_fraction"] == 0.5


# -- profiles and the catalog ------------------------------------------------------------------
BASE = {
    "name": "toy",
    "compute_flops": 1e9,
    "memory_bytes": 2**20,
    "uplink_bps": 1e6,
    "downlink_bps": 1e7,
}


def test_profile_accepts_radio_energy_per_byte_in_both_directions() -> None:
    p = parse_profile({**BASE, "energy_per_byte_up": 2e-6, "energy_per_byte_down": 1e-6})

    assert (p.energy_per_byte_up, p.energy_per_byte_down) == (2e-6, 1e-6)
    assert parse_profile(BASE).energy_per_byte_up is None


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"energy_per_byte_up": 2e-6}, "energy_per_byte_down"),
        ({"energy_per_byte_down": 2e-6}, "energy_per_byte_down"),
        ({"energy_per_byte_up": -1.0, "energy_per_byte_down": 1e-6}, "energy_per_byte_up"),
        ({"energy_per_byte_up": 1e-6, "energy_per_byte_down": math.inf}, "energy_per_byte_down"),
        ({"energy_per_byte_up": "1e-6", "energy_per_byte_down": 1e-6}, "energy_per_byte_up"),
    ],
)
def test_bad_radio_energy_is_one_line_naming_the_field(extra: dict, field: str) -> None:
    with pytest.raises(ProfileError) as info:
        parse_profile({**BASE, **extra}, where="device[3].")

    message = str(info.value)
    assert message.count("\n") == 0
    assert message.startswith(f"device profile error: device[3].{field} = ")
    assert "joules per byte" in message


def test_every_catalog_device_has_energy_figures_with_their_origin() -> None:
    for key, p in load_catalog().items():
        assert p.energy_per_flop is not None, key
        assert p.energy_per_byte_up is not None and p.energy_per_byte_down is not None, key
        assert "energy:" in p.source and "radio:" in p.source, key


# Huang et al., MobiSys 2012: data-transfer power = alpha_u t_u + alpha_d t_d + beta (mW, Mbit/s)
HUANG = {"LTE": (438.39, 51.97, 1288.04), "Wi-Fi": (283.17, 137.01, 132.86)}


def test_catalog_radio_energy_is_the_cited_model_at_the_devices_bandwidth() -> None:
    """Each J/byte is 8e-9 (alpha + beta / t) at the entry's own bandwidth t (Mbit/s), rounded
    to 3 significant digits, with the model its source names."""
    for key, p in load_catalog().items():
        model = re.search(r"Huang et al\. MobiSys 2012 (LTE|Wi-Fi) power model", p.source)
        assert model is not None, key
        alpha_u, alpha_d, beta = HUANG[model.group(1)]
        up = 8e-9 * (alpha_u + beta / (p.uplink_bps / 1e6))
        down = 8e-9 * (alpha_d + beta / (p.downlink_bps / 1e6))
        assert p.energy_per_byte_up == float(f"{up:.2e}"), key
        assert p.energy_per_byte_down == float(f"{down:.2e}"), key


def test_checkpoint_ledger_rows_carry_energy_and_read_old_rows_as_unknown() -> None:
    row = as_dicts([entry(10, 4, 2, 0.5, None)])[0]
    adapter = TypeAdapter(LedgerRow)

    assert adapter.validate_python(row) == row
    old = {k: v for k, v in row.items() if not k.startswith("energy_")}
    assert LedgerEntry(**adapter.validate_python(old)).energy_compute_j is None
    with pytest.raises(ValidationError):
        adapter.validate_python({**row, "energy_radio_j": "0.5"})
