"""Device profiles, catalog, fleets and host probe (radbo.devices)."""

from __future__ import annotations

import json
import math
import tempfile
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radbo.devices import (
    DeviceProfile,
    Fleet,
    ProfileError,
    get_device,
    largest_remainder_counts,
    load_catalog,
    parse_profile,
    probe_host,
)

FLOAT_FIELDS = ("compute_flops", "uplink_bps", "downlink_bps", "availability", "energy_per_flop")
POSITIVE_FLOAT_FIELDS = ("compute_flops", "uplink_bps", "downlink_bps", "energy_per_flop")


def valid_record(**overrides: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "name": "toy",
        "compute_flops": 1e9,
        "memory_bytes": 2**20,
        "uplink_bps": 1e6,
        "downlink_bps": 1e7,
    }
    record.update(overrides)
    return record


def error_lines(data: Any) -> list[str]:
    with pytest.raises(ProfileError) as info:
        parse_profile(data)
    return str(info.value).splitlines()


# -- DeviceProfile validation ---------------------------------------------------------------
def test_valid_record_parses_with_defaults() -> None:
    profile = parse_profile(valid_record())

    assert profile.compute_flops == 1e9
    assert profile.memory_bytes == 2**20
    assert (profile.availability, profile.energy_per_flop, profile.tier, profile.source) == (
        1.0,
        None,
        "",
        "",
    )


def test_profile_is_frozen() -> None:
    profile = parse_profile(valid_record())

    with pytest.raises(ValueError):
        profile.compute_flops = 2.0  # type: ignore[misc]

    assert profile.compute_flops == 1e9


@pytest.mark.parametrize("field", POSITIVE_FLOAT_FIELDS + ("memory_bytes",))
@pytest.mark.parametrize("bad", [-1, 0])
def test_non_positive_number_gives_one_line_naming_field(field: str, bad: int) -> None:
    lines = error_lines(valid_record(**{field: bad}))

    assert len(lines) == 1
    assert lines[0].startswith(f"device profile error: {field} = {bad!r}: ")
    assert "greater than 0" in lines[0] or "greater than or equal to 1" in lines[0]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_rejected(field: str, bad: float) -> None:
    lines = error_lines(valid_record(**{field: bad}))

    assert len(lines) == 1
    assert lines[0].startswith(f"device profile error: {field} = {bad!r}: ")
    assert "finite" in lines[0]


@pytest.mark.parametrize("field", FLOAT_FIELDS + ("memory_bytes",))
def test_bool_is_not_a_number(field: str) -> None:
    lines = error_lines(valid_record(**{field: True}))

    assert lines == [lines[0]]
    assert lines[0].startswith(f"device profile error: {field} = True: ")


def test_memory_bytes_must_be_an_int() -> None:
    lines = error_lines(valid_record(memory_bytes=1.5e9))

    assert len(lines) == 1
    assert lines[0].startswith("device profile error: memory_bytes = 1500000000.0: ")


def test_missing_fields_each_get_a_line() -> None:
    record = valid_record()
    del record["compute_flops"], record["uplink_bps"]

    lines = error_lines(record)

    assert lines == [
        "device profile error: compute_flops = <missing>: Field required (allowed: a number in "
        "[1, 1e21], sustained FP32 training throughput in FLOP/s)",
        "device profile error: uplink_bps = <missing>: Field required (allowed: a number in "
        "[1, 1e15], uplink bandwidth in bit/s)",
    ]


def test_unknown_field_is_named() -> None:
    lines = error_lines(valid_record(colour="red"))

    assert len(lines) == 1
    assert lines[0].startswith("device profile error: colour = 'red': unknown field")


def test_empty_name_rejected() -> None:
    lines = error_lines(valid_record(name=""))

    assert len(lines) == 1
    assert lines[0].startswith("device profile error: name = '': ")


def test_several_problems_one_line_each() -> None:
    lines = error_lines(valid_record(compute_flops=-1.0, memory_bytes=0, availability=2.0))

    assert [line.split(" = ")[0] for line in lines] == [
        "device profile error: compute_flops",
        "device profile error: memory_bytes",
        "device profile error: availability",
    ]


@pytest.mark.parametrize("bad", [-0.01, 1.01])
def test_availability_outside_unit_interval_rejected(bad: float) -> None:
    lines = error_lines(valid_record(availability=bad))

    assert len(lines) == 1
    assert lines[0].startswith(f"device profile error: availability = {bad!r}: ")


@pytest.mark.parametrize("edge", [0.0, 1.0, 0, 1])
def test_availability_boundaries_accepted(edge: float) -> None:
    profile = parse_profile(valid_record(availability=edge))

    assert profile.availability == edge


def test_non_mapping_rejected_with_profile_error() -> None:
    lines = error_lines([1, 2, 3])

    assert len(lines) == 1
    assert lines[0].startswith("device profile error: <profile> = [1, 2, 3]: expected a table")


# -- property tests -------------------------------------------------------------------------
positive_floats = st.floats(min_value=0, exclude_min=True, allow_nan=False, allow_infinity=False)
valid_records = st.fixed_dictionaries(
    {
        "name": st.text(min_size=1, max_size=20),
        "compute_flops": st.floats(min_value=1, max_value=1e21),
        "memory_bytes": st.integers(min_value=1, max_value=2**63),
        "uplink_bps": st.floats(min_value=1, max_value=1e15),
        "downlink_bps": st.floats(min_value=1, max_value=1e15),
    },
    optional={
        "availability": st.floats(min_value=0, max_value=1),
        "energy_per_flop": positive_floats | st.none(),
        "tier": st.text(max_size=10),
        "source": st.text(max_size=40),
    },
)
non_numbers = st.sampled_from([True, False, "1e9", [1.0], {"v": 1.0}])
not_positive = (
    st.floats(max_value=0)  # includes 0.0, -0.0 and -inf
    | st.sampled_from([math.nan, math.inf])
    | st.integers(max_value=0)
    | non_numbers
)
BAD_VALUES = {
    "compute_flops": not_positive | st.none(),
    "uplink_bps": not_positive | st.none(),
    "downlink_bps": not_positive | st.none(),
    "energy_per_flop": not_positive,  # None means "unknown" and is allowed
    "memory_bytes": st.integers(max_value=0) | st.floats() | non_numbers | st.none(),
    "availability": st.floats(max_value=-5e-324)
    | st.floats(min_value=1, exclude_min=True)
    | st.sampled_from([math.nan, math.inf])
    | st.integers(min_value=2)
    | st.integers(max_value=-1)
    | non_numbers
    | st.none(),
}


@settings(max_examples=100, deadline=None)
@given(record=valid_records)
def test_random_valid_records_parse(record: dict[str, Any]) -> None:
    profile = parse_profile(record)

    assert {key: getattr(profile, key) for key in record} == record


@settings(max_examples=200, deadline=None)
@given(record=valid_records, data=st.data())
def test_random_invalid_numbers_raise_profile_error_naming_field(
    record: dict[str, Any], data: st.DataObject
) -> None:
    field = data.draw(st.sampled_from(sorted(BAD_VALUES)), label="field")
    bad = data.draw(BAD_VALUES[field], label="bad")

    lines = error_lines({**record, field: bad})

    assert len(lines) == 1
    assert lines[0].startswith(f"device profile error: {field} = ")


# -- catalog ----------------------------------------------------------------------------------
def test_catalog_has_sourced_devices_spanning_mcu_to_laptop() -> None:
    catalog = load_catalog()

    computes = [p.compute_flops for p in catalog.values()]
    memories = [p.memory_bytes for p in catalog.values()]
    assert len(catalog) >= 8
    assert all(p.source.strip() and p.tier.strip() for p in catalog.values())
    assert {"mcu", "sbc", "phone-low", "phone-mid", "phone-high", "laptop"} <= {
        p.tier for p in catalog.values()
    }
    assert max(computes) / min(computes) >= 100
    assert max(memories) / min(memories) >= 100


def test_catalog_entries_cite_every_kind_of_number() -> None:
    catalog = load_catalog()

    for key, profile in catalog.items():
        for part in ("compute:", "memory:", "network:", "availability:"):
            assert part in profile.source, (key, part)


def test_catalog_mcu_is_esp32_s3_with_psram_budget() -> None:
    mcu = get_device("esp32_s3")

    assert mcu.tier == "mcu"
    assert mcu.memory_bytes <= 8 * 2**20 + 512 * 2**10
    assert 1e8 <= mcu.compute_flops <= 1e9


def test_load_catalog_returns_independent_dicts() -> None:
    first = load_catalog()
    first.pop("esp32_s3")

    second = load_catalog()

    assert "esp32_s3" in second


def test_get_device_typo_lists_known_ids() -> None:
    with pytest.raises(ValueError) as info:
        get_device("rasberry_pi_4")

    message = str(info.value)
    assert message.startswith("unknown device 'rasberry_pi_4': known devices are ")
    assert all(key in message for key in load_catalog())
    assert "did you mean 'raspberry_pi_4'?" in message


# -- fleet: tier mix ------------------------------------------------------------------------
def test_largest_remainder_hand_cases() -> None:
    assert largest_remainder_counts([0.5, 0.5], 10) == [5, 5]
    assert largest_remainder_counts([1, 1, 1], 10) == [4, 3, 3]
    assert largest_remainder_counts([0.1, 0.2, 0.7], 10) == [1, 2, 7]
    assert largest_remainder_counts([0.15, 0.85, 0.0], 3) == [0, 3, 0]  # quotas .45, 2.55, 0
    assert largest_remainder_counts([2, 0, 1], 7) == [5, 0, 2]  # quotas 4.67, 0, 2.33


def test_from_tiers_exact_counts() -> None:
    fleet = Fleet.from_tiers({"raspberry_pi_4": 0.5, "phone_low": 0.3, "esp32_s3": 0.2}, 10, 0)

    counts = Counter(p.name for p in fleet)
    assert len(fleet) == 10
    assert counts == {
        get_device("raspberry_pi_4").name: 5,
        get_device("phone_low").name: 3,
        get_device("esp32_s3").name: 2,
    }


def test_from_tiers_deterministic_under_seed_and_seed_changes_order() -> None:
    mix = {"raspberry_pi_5": 0.5, "phone_mid": 0.5}

    a = Fleet.from_tiers(mix, 10, seed=3)
    b = Fleet.from_tiers(mix, 10, seed=3)
    c = Fleet.from_tiers(mix, 10, seed=4)

    assert a == b
    assert a.tiers() == b.tiers()
    assert a.tiers() != c.tiers()
    assert Counter(a.tiers()) == Counter(c.tiers()) == {"sbc": 5, "phone-mid": 5}


def test_from_tiers_with_custom_catalog() -> None:
    tiny = parse_profile(valid_record(name="tiny", tier="t"))
    big = parse_profile(valid_record(name="big", compute_flops=1e12))

    fleet = Fleet.from_tiers({"tiny": 1, "big": 3}, 4, seed=0, catalog={"tiny": tiny, "big": big})

    assert sorted(fleet.tiers()) == ["big", "big", "big", "t"]


def test_from_tiers_unknown_device_lists_known_ids() -> None:
    with pytest.raises(ValueError) as info:
        Fleet.from_tiers({"raspberry_pi_4": 1.0, "pixel_99": 1.0}, 4, seed=0)

    assert "unknown device 'pixel_99'" in str(info.value)
    assert "raspberry_pi_4" in str(info.value)


@pytest.mark.parametrize(
    ("mix", "num_clients", "seed", "needle"),
    [
        ({"raspberry_pi_4": -1.0}, 4, 0, "mix['raspberry_pi_4'] = -1.0"),
        ({"raspberry_pi_4": math.nan}, 4, 0, "mix['raspberry_pi_4'] = nan"),
        ({"raspberry_pi_4": True}, 4, 0, "mix['raspberry_pi_4'] = True"),
        ({"raspberry_pi_4": 0.0}, 4, 0, "at least one weight must be > 0"),
        ({}, 4, 0, "at least one device id"),
        ({"raspberry_pi_4": 1.0}, 0, 0, "num_clients = 0"),
        ({"raspberry_pi_4": 1.0}, 4, -1, "seed = -1"),
    ],
)
def test_from_tiers_rejects_bad_arguments(
    mix: dict[str, float], num_clients: int, seed: int, needle: str
) -> None:
    with pytest.raises(ValueError) as info:
        Fleet.from_tiers(mix, num_clients, seed)

    assert needle in str(info.value)


# -- fleet: FedScale-style trace ------------------------------------------------------------
TRACE = {
    "10": {"computation": 50.0, "communication": 2000.0},
    "2": {"computation": 125, "communication": 512.5},
}


def test_from_trace_json_and_toml_give_hand_computed_numbers(tmp_path: Path) -> None:
    json_path = tmp_path / "capacity.json"
    json_path.write_text(json.dumps(TRACE), encoding="utf-8")
    toml_path = tmp_path / "capacity.toml"
    toml_path.write_text(
        "[2]\ncomputation = 125\ncommunication = 512.5\n\n"
        "[10]\ncomputation = 50.0\ncommunication = 2000.0\n",
        encoding="utf-8",
    )

    fleets = [
        Fleet.from_trace(p, flops_per_sample=2e6, memory_bytes=2**30, availability=0.5)
        for p in (json_path, toml_path)
    ]

    dumps = [[p.model_dump(exclude={"source"}) for p in fleet] for fleet in fleets]
    assert dumps[0] == dumps[1]
    assert "capacity.toml, client 2: computation 125.0 ms/sample" in fleets[1][0].source
    first, second = fleets[0]
    # client ids sorted numerically: 2 before 10
    assert first.name == "client 2"
    assert first.compute_flops == 2e6 / (125 / 1000)  # 1.6e7 FLOP/s
    assert first.compute_flops == 1.6e7
    assert first.uplink_bps == first.downlink_bps == 512_500.0
    assert second.name == "client 10"
    assert second.compute_flops == 4e7
    assert second.uplink_bps == second.downlink_bps == 2_000_000.0
    assert {p.memory_bytes for p in fleets[0]} == {2**30}
    assert {p.availability for p in fleets[0]} == {0.5}
    assert fleets[0].tiers() == ["trace", "trace"]


def test_from_trace_with_base_profile(tmp_path: Path) -> None:
    path = tmp_path / "capacity.json"
    path.write_text(json.dumps(TRACE), encoding="utf-8")
    base = get_device("phone_mid")

    fleet = Fleet.from_trace(path, flops_per_sample=1e6, memory_bytes=2**28, base=base)

    assert fleet.tiers() == ["phone-mid", "phone-mid"]
    assert fleet[0].name == f"{base.name} (client 2)"
    assert fleet[0].energy_per_flop == base.energy_per_flop
    assert fleet[0].compute_flops == 8e6


@pytest.mark.parametrize(
    ("entry", "needle"),
    [
        ({"computation": -5.0, "communication": 100.0}, "trace['7'].computation = -5.0"),
        ({"computation": 5.0, "communication": math.inf}, "trace['7'].communication = inf"),
        ({"computation": True, "communication": 100.0}, "trace['7'].computation = True"),
        ({"computation": "5", "communication": 100.0}, "trace['7'].computation = '5'"),
        ({"communication": 100.0}, "trace['7'].computation = <missing>"),
        ({"computation": 5.0, "communication": 1.0, "gpu": 1}, "trace['7'].gpu = 1: unknown"),
    ],
)
def test_from_trace_bad_entry_names_client_and_field(
    tmp_path: Path, entry: dict[str, Any], needle: str
) -> None:
    path = tmp_path / "capacity.json"
    path.write_text(json.dumps({"1": TRACE["2"], "7": entry}), encoding="utf-8")

    with pytest.raises(ProfileError) as info:
        Fleet.from_trace(path, flops_per_sample=1e6, memory_bytes=2**20)

    assert len(str(info.value).splitlines()) == 1
    assert needle in str(info.value)


def test_from_trace_non_numeric_client_id(tmp_path: Path) -> None:
    path = tmp_path / "capacity.json"
    path.write_text(json.dumps({"alice": TRACE["2"]}), encoding="utf-8")

    with pytest.raises(ProfileError, match=r"trace\['alice'\].*client ids must be integers"):
        Fleet.from_trace(path, flops_per_sample=1e6, memory_bytes=2**20)


def test_from_trace_duplicate_client_ids(tmp_path: Path) -> None:
    same_number = tmp_path / "a.json"
    same_number.write_text(json.dumps({"1": TRACE["2"], "01": TRACE["2"]}), encoding="utf-8")
    same_key = tmp_path / "b.json"
    same_key.write_text('{"1": {"computation": 1, "communication": 1}, "1": {}}', encoding="utf-8")

    with pytest.raises(ProfileError, match="client id 1 appears twice"):
        Fleet.from_trace(same_number, flops_per_sample=1e6, memory_bytes=2**20)
    with pytest.raises(ProfileError, match="'1' appears twice"):
        Fleet.from_trace(same_key, flops_per_sample=1e6, memory_bytes=2**20)


def test_from_trace_refuses_pickle(tmp_path: Path) -> None:
    path = tmp_path / "client_device_capacity"
    path.write_bytes(b"\x80\x04.")

    with pytest.raises(ValueError, match=r"\.json or \.toml"):
        Fleet.from_trace(path, flops_per_sample=1e6, memory_bytes=2**20)


# -- fleet: files ---------------------------------------------------------------------------
def mixed_fleet() -> Fleet:
    odd = parse_profile(
        valid_record(
            name='quote " backslash \\ tab \t newline \n del \x7f é 😀',
            compute_flops=1.2345678901234567,
            memory_bytes=2**62,
            uplink_bps=1e15,
            availability=0.0,
            energy_per_flop=5e-324,
            source="",
        )
    )
    return Fleet.from_profiles([*load_catalog().values(), odd])


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_file_round_trip_is_exact(tmp_path: Path, suffix: str) -> None:
    fleet = mixed_fleet()
    path = tmp_path / f"fleet{suffix}"

    fleet.to_file(path)
    loaded = Fleet.from_file(path)

    assert loaded == fleet
    assert [p.model_dump() for p in loaded] == [p.model_dump() for p in fleet]
    assert [p.name for p in tmp_path.iterdir()] == [f"fleet{suffix}"]  # no temp file left


def test_files_are_readable_lists_of_devices(tmp_path: Path) -> None:
    unknown = dict.fromkeys(("energy_per_flop", "energy_per_byte_up", "energy_per_byte_down"))
    no_energy = get_device("esp32_s3").model_copy(update=unknown)
    fleet = Fleet.from_profiles([get_device("raspberry_pi_4"), no_energy])
    fleet.to_file(tmp_path / "f.json")
    fleet.to_file(tmp_path / "f.toml")

    as_json = json.loads((tmp_path / "f.json").read_text(encoding="utf-8"))
    as_toml = tomllib.loads((tmp_path / "f.toml").read_text(encoding="utf-8"))

    assert as_json == as_toml
    assert [d["name"] for d in as_json["device"]] == [p.name for p in fleet]
    assert not set(unknown) & set(as_json["device"][1])  # None is left out
    assert "[[device]]" in (tmp_path / "f.toml").read_text(encoding="utf-8")


@settings(max_examples=40, deadline=None)
@given(records=st.lists(valid_records, min_size=1, max_size=3))
def test_random_fleets_round_trip_through_both_formats(records: list[dict[str, Any]]) -> None:
    fleet = Fleet.from_profiles([parse_profile(r) for r in records])

    with tempfile.TemporaryDirectory() as tmp:
        loaded = []
        for suffix in (".json", ".toml"):
            path = Path(tmp) / f"fleet{suffix}"
            fleet.to_file(path)
            loaded.append(Fleet.from_file(path))

    assert loaded == [fleet, fleet]


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_corrupted_fleet_file_names_client_index_and_field(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"fleet{suffix}"
    Fleet.from_profiles([get_device("raspberry_pi_4")] * 3).to_file(path)
    text = path.read_text(encoding="utf-8")
    # corrupt client 2 only: its compute becomes negative and its memory a string
    head, sep, last = text.rpartition("11889000000.0")
    last = last.replace("2147483648", '"lots"', 1)
    path.write_text(head + "-5.0" + last, encoding="utf-8")

    with pytest.raises(ProfileError) as info:
        Fleet.from_file(path)

    lines = str(info.value).splitlines()
    assert sep == "11889000000.0"
    assert [line.split(": ")[1].split(" = ")[0] for line in lines] == [
        "device[2].compute_flops",
        "device[2].memory_bytes",
    ]


def test_fleet_file_without_devices_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('format = "radbo-fleet"\nversion = 1\nextra = 2\n', encoding="utf-8")

    with pytest.raises(ProfileError) as info:
        Fleet.from_file(path)

    lines = str(info.value).splitlines()
    assert lines[0].startswith("device profile error: extra = 2: unknown top-level key")
    assert lines[1].startswith("device profile error: device = None: expected a non-empty list")


def test_fleet_file_invalid_json_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.json"
    bad.write_text("{not json", encoding="utf-8")

    with pytest.raises(ProfileError, match="is not valid JSON"):
        Fleet.from_file(bad)
    with pytest.raises(ProfileError, match="does not exist"):
        Fleet.from_file(tmp_path / "absent.toml")


def test_to_file_rejects_other_suffixes(tmp_path: Path) -> None:
    fleet = Fleet.from_profiles([get_device("phone_low")])

    with pytest.raises(ValueError, match=r"\.json or \.toml"):
        fleet.to_file(tmp_path / "fleet.pkl")

    assert list(tmp_path.iterdir()) == []


# -- fleet: sequence, tiers, table ----------------------------------------------------------
def test_fleet_is_an_immutable_sequence() -> None:
    pi, phone = get_device("raspberry_pi_4"), get_device("phone_high")
    fleet = Fleet.from_profiles([pi, phone, pi])

    assert len(fleet) == 3
    assert fleet[1] == phone
    assert list(fleet) == [pi, phone, pi]
    assert fleet[1:] == Fleet.from_profiles([phone, pi])
    assert isinstance(fleet.profiles, tuple)
    with pytest.raises(AttributeError):
        fleet.profiles = ()  # type: ignore[misc]


def test_empty_fleet_and_non_profiles_rejected() -> None:
    with pytest.raises(ValueError, match="at least one client"):
        Fleet.from_profiles([])
    with pytest.raises(TypeError, match="client 1 is a dict"):
        Fleet.from_profiles([get_device("phone_low"), valid_record()])  # type: ignore[list-item]


def test_tiers_fall_back_to_name_and_table_converts_units() -> None:
    untiered = parse_profile(
        valid_record(name="bare", compute_flops=2.5e9, memory_bytes=3_000_000, availability=0.5)
    )
    fleet = Fleet.from_profiles([get_device("phone_mid"), untiered])

    rows = fleet.table()

    assert fleet.tiers() == ["phone-mid", "bare"]
    assert rows[1] == {
        "index": 1,
        "name": "bare",
        "tier": "bare",
        "compute_gflops": 2.5,
        "memory_mb": 3.0,
        "uplink_mbps": 1.0,
        "downlink_mbps": 10.0,
        "availability": 0.5,
    }
    assert rows[0]["index"] == 0


# -- probe ----------------------------------------------------------------------------------
def test_probe_host_returns_a_valid_profile() -> None:
    profile = probe_host(matmul_size=128, repeats=2, memory_fraction=0.25)

    assert isinstance(profile, DeviceProfile)
    assert profile.name == "host" and profile.tier == "host"
    assert profile.compute_flops > 1e6
    assert profile.memory_bytes > 0
    assert profile.uplink_bps == profile.downlink_bps == 100e6
    assert "torch.mm 128x128" in profile.source and "logical CPUs" in profile.source


def test_probe_host_takes_bandwidth_and_rejects_bad_arguments() -> None:
    profile = probe_host(matmul_size=16, repeats=1, uplink_bps=5e6, downlink_bps=2e7)

    assert (profile.uplink_bps, profile.downlink_bps) == (5e6, 2e7)
    with pytest.raises(ValueError, match="memory_fraction = 0"):
        probe_host(matmul_size=16, memory_fraction=0)
    with pytest.raises(ValueError, match="matmul_size = 0"):
        probe_host(matmul_size=0)
