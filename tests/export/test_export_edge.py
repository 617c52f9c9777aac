"""``radbo export --format pte,onnx``: ExecuTorch programs and ONNX models checked in their own
runtimes, their latency, loading them back safely, and ``radbo fleet --calibrate``.

Every round trip is read from the runtime's own output (``executorch.runtime`` /
``onnxruntime``, through :func:`radbo.export.load_exported`) and compared, in float64, with a
masked full model this file builds itself from the manifest's kept indices. The default suite
exports the demo's MLP at capacities 1, 1/2 and 1/4 to both formats (plus int8) and a
BatchNorm CNN; ``-m slow`` runs every model of the zoo at the three capacities.

Both sides compute float32 logits, in different orders (XNNPACK's and ONNX Runtime's kernels
against PyTorch's, whichever ``ATEN_CPU_CAPABILITY`` runs), so they are held to a bound derived
from float32's unit roundoff and the network (:func:`_round_trip_bound`), not to a number read
off one CPU (issue 25).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import radbo.edge
from radbo.cli import main
from radbo.config import RunConfig, parse_config
from radbo.devices import parse_profile
from radbo.edge import EDGE_FORMATS, EdgeProgram, ExportError, load_program, lower, parse_formats
from radbo.experiment import build
from radbo.export import (
    calibrate,
    export_submodels,
    forward_flops,
    load_exported,
    logit_rounding_bound,
    read_manifest,
)
from radbo.masks.index import dense_mask
from radbo.masks.structure import StructurePlan
from tests.configs import DEMO, demo_dict
from tests.tolerances import unit_roundoff

EDGE_PACKAGES = ("executorch", "onnx", "onnxscript", "onnxruntime")
MISSING = [p for p in EDGE_PACKAGES if importlib.util.find_spec(p) is None]
needs_edge = pytest.mark.skipif(
    bool(MISSING),
    reason=f"radbo[edge] not installed (missing {', '.join(MISSING)}): pip install 'radbo[edge]'",
)
#: how far the zoo's ResNets' runtime logits may be from PyTorch's, in multiples of PyTorch's
#: own float32 error on the same batch (see :func:`_round_trip_bound`)
ERROR_MULTIPLE = 16

SMALL_TOML = """
seed = 3
[model]
name = "mlp"
hidden = [16]
[fleet]
num_clients = 3
capacities = [1.0, 0.5]
[mask]
policy = "leading"
"""


def _config(**sections) -> RunConfig:
    """The demo config (10 clients at capacities 1, 1/2, 1/4) with whole sections replaced."""
    data = demo_dict()
    data.update(rounds=1, eval_every=1)
    data.pop("baseline")
    data.update(sections)
    return parse_config(data)


def _index_set(kept: dict) -> dict:
    return {
        name: tuple(None if e is None else torch.tensor(e, dtype=torch.long) for e in dims)
        for name, dims in kept.items()
    }


def _reference(config: RunConfig):
    """(inputs, masked-full-model logits for a manifest entry, as float32 and float64): built
    here from the config, independently of radbo.export."""
    exp = build(config)
    model = exp.model
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    plan = StructurePlan(model, model.example_input(1), output_layers=model.output_layers)
    inputs = exp.test.features[:32].to(torch.float32)

    def logits(entry: dict) -> tuple[torch.Tensor, torch.Tensor]:
        masks = dense_mask(_index_set(entry["kept"]), plan.shapes)
        masked = {k: torch.where(masks[k], v, torch.zeros_like(v)) for k, v in full.items()}
        net = copy.deepcopy(model)
        net.load_state_dict(masked)
        with torch.no_grad():
            return net.eval()(inputs), net.double()(inputs.double())

    return inputs, logits


def _round_trip_bound(model: nn.Module, inputs: torch.Tensor, torch_error: float) -> float:
    """How far a runtime's float32 logits may be from PyTorch's float32 logits of the masked
    full model (both within it of each other, whatever the kernels).

    :func:`radbo.export.logit_rounding_bound`, the worst case derived from float32's unit
    roundoff and the operation count, wherever it is informative: below 1 % of the logits, so
    that a wrong channel (which moves logits by a sizeable part of them) still fails. That holds
    for every model but the zoo's ResNets (-m slow), whose worst case (every rounding aligned,
    through 20 layers of |W|) is 1.5e4 and 1.5e5, vacuous. For those the bound is
    ``ERROR_MULTIPLE`` times PyTorch's own float32 error against float64 on the same batch
    (``torch_error``, measured by the test on the CPU it runs on; floored at ``u`` times the
    largest logit): XNNPACK and ONNX Runtime round the same operations in another order, so
    their errors are of the same size. Measured over the zoo, every model and capacity, on an
    AVX-512 CPU: runtime vs PyTorch float32 within 1.5x to 3.7x ``torch_error`` (ResNet-12:
    6.0e-7 against 3.9e-7; ResNet-18: 6.0e-8 against 1.6e-8).
    """
    with torch.no_grad():
        largest = float(model.eval()(inputs).abs().max())
    bound = logit_rounding_bound(model, inputs)
    if bound < 0.01 * largest:
        return bound
    return ERROR_MULTIPLE * max(torch_error, unit_roundoff(torch.float32) * largest)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return float((a.double() - b.double()).abs().max())


def _assert_round_trips(config: RunConfig, out: Path, formats: tuple[str, ...]) -> dict:
    """Every client's program of every format, loaded from ``out`` in its runtime, reproduces
    the masked full model within :func:`_round_trip_bound` (measured, default/avx2/avx512:
    demo MLP at most 1.2e-7 against a derived 2.3e-4, BatchNorm CNN 3.3e-8 against 1.3e-4); returns
    the manifest."""
    manifest = read_manifest(out)
    inputs, logits = _reference(config)
    wants = {entry["client"]: logits(entry) for entry in manifest["clients"]}
    torch_error = max(_max_diff(w32, w64) for w32, w64 in wants.values())
    bound = _round_trip_bound(build(config).model, inputs, torch_error)
    for entry in manifest["clients"]:
        want, _ = wants[entry["client"]]
        for fmt in formats:
            # Act: the runtime's own output
            program = load_exported(out, entry["client"], fmt)
            got = program(inputs)

            # Assert
            diff = _max_diff(got, want)
            assert diff <= bound, (entry["client"], fmt, diff, bound)
            assert entry[fmt]["max_abs_diff"] <= bound
            assert (
                entry[fmt]["file"]
                == f"client-{min([entry['client'], *entry['shared_with']])}.{fmt}"
            )
    assert manifest["check"]["passed"] and manifest["check"]["unsupported"] == []
    return manifest


# ---------------------------------------------------------------- options (no packages needed)
def test_formats_parse_and_bad_options_are_one_sentence(tmp_path: Path) -> None:
    assert parse_formats("onnx,pte , safetensors") == ("safetensors", "pte", "onnx")
    assert parse_formats(["PTE"]) == ("pte",)
    config = _config()

    cases = {
        "format": (dict(formats="safetensors,tflite"), "format 'tflite' is not one radbo writes"),
        "empty": (dict(formats=" "), "format '' is not one radbo writes"),
        "quantize": (dict(formats="onnx", quantize="int8"), "add pte to the formats"),
        "int4": (dict(formats="pte", quantize="int4"), "quantize = 'int4' is not offered"),
        "runs": (dict(latency_runs=-1), "latency_runs = -1: must be an integer >= 0"),
    }
    for name, (kwargs, text) in cases.items():
        with pytest.raises(ExportError, match=re.escape(text)) as info:
            export_submodels(config, tmp_path / name, **kwargs)
        assert "\n" not in str(info.value)
        assert not (tmp_path / name).exists()  # refused before anything is written


def test_a_missing_runtime_package_is_named_with_the_install_command(
    monkeypatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(
        radbo.edge, "missing_packages", lambda fmt: ["executorch"] if fmt == "pte" else []
    )

    with pytest.raises(ExportError) as info:
        export_submodels(_config(), tmp_path, formats="safetensors,pte")

    assert str(info.value) == (
        "export error: format 'pte' needs executorch, which is not installed; install them "
        "with: pip install 'radbo[edge]'"
    )
    assert main(["export", str(DEMO), "--format", "pte", "--output", str(tmp_path)]) == 2


# ---------------------------------------------------------------- the demo, both formats
@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("edge")
    config = _config()
    result = export_submodels(config, out, formats="safetensors,pte,onnx", latency_runs=2)
    return config, out, result


@pytest.mark.float_sensitive
@needs_edge
def test_demo_round_trips_at_every_capacity_in_both_runtimes(demo) -> None:
    config, out, result = demo

    manifest = _assert_round_trips(config, out, ("pte", "onnx"))

    assert manifest == json.loads(json.dumps(result.manifest))
    assert {e["capacity"] for e in manifest["clients"]} == {1.0, 0.5, 0.25}
    assert manifest["formats"] == ["safetensors", "pte", "onnx"]
    assert sorted(p.name for p in out.glob("*.pte")) == [
        "client-0.pte",
        "client-2.pte",
        "client-3.pte",
    ]
    for entry in manifest["clients"]:
        assert entry["pte_int8"] is None
        for fmt in ("pte", "onnx"):
            record = entry[fmt]
            data = (out / record["file"]).read_bytes()
            assert record["bytes"] == len(data)
            assert record["sha256"] == radbo.edge.digest(data)
            assert record["dynamic_batch"] is True


@needs_edge
def test_latency_is_recorded_per_runtime_at_batch_1_and_the_training_batch(demo) -> None:
    _, _, result = demo
    edge = result.manifest["edge"]
    assert edge["latency_runs"] == 2 and edge["latency_batches"] == [1, 32]
    assert edge["threads"] == torch.get_num_threads()
    assert edge["versions"]["executorch"] == "1.5.1"
    for entry in result.clients:
        for fmt in ("pte", "onnx"):
            latency = entry[fmt]["latency"]
            assert [t["batch"] for t in latency] == [1, 32]
            for t in latency:
                assert t["runs"] == 2 and t["median_s"] > 0
                assert t["per_sample_s"] == t["median_s"] / t["batch"]


@pytest.mark.float_sensitive
@needs_edge
def test_int8_program_reports_its_accuracy_against_fp32(tmp_path: Path) -> None:
    # Arrange: every tier at r = 1, so one submodel (int8 lowering is the slow part)
    fleet = {**demo_dict()["fleet"], "capacities": {"laptop": 1.0, "phone-mid": 1.0}}
    fleet["capacities"].update({"sbc": 1.0, "phone-low": 1.0})
    config = _config(fleet=fleet)
    inputs, _ = _reference(config)
    test = build(config).test

    # Act
    result = export_submodels(config, tmp_path, formats="pte", quantize="int8", latency_runs=1)

    # Assert
    assert result.manifest["submodels"] == 1 and result.manifest["edge"]["quantize"] == "int8"
    assert result.manifest["edge"]["calibration_examples"] == 256
    for entry in result.clients:
        record = entry["pte_int8"]
        assert record["file"] == "client-0.int8.pte"
        assert record["quantize"] == "int8" and "max_abs_diff" not in record
        assert record["examples"] == len(test.labels)
        assert record["accuracy_drop"] == (
            record["test_accuracy_fp32"] - record["test_accuracy_int8"]
        )
        # int8 against FP32 (XNNPACK's int8 kernels, whatever the CPU's torch kernels): measured
        # top-1 agreement 1.0 (avx2/avx512) and largest difference 0.0081 (default/avx2/avx512),
        # far inside these bounds, which ask only that quantization changed the logits a little
        assert 0.5 <= record["top1_agreement"] <= 1.0
        assert 0 < record["max_abs_diff_vs_fp32"] < 1.0  # quantized: close, not equal
        assert [t["batch"] for t in record["latency"]] == [1, 32]
        program = load_exported(tmp_path, entry["client"], "pte_int8")
        assert program(inputs).shape == (32, 10)
    assert result.passed  # the int8 program is not held to the FP32 tolerance


# ---------------------------------------------------------------- safety of loading
@needs_edge
@pytest.mark.parametrize("fmt", ["pte", "onnx"])
def test_a_truncated_file_is_refused_naming_it(demo, fmt: str, tmp_path: Path) -> None:
    _, out, _ = demo
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    path = folder / f"client-3.{fmt}"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])

    with pytest.raises(ExportError) as info:
        load_exported(folder, 3, fmt)

    assert str(info.value) == (
        f"export error: {path} has {len(data) // 2} bytes but the manifest records "
        f"{len(data)}: the file is truncated or was replaced; export again"
    )


@needs_edge
@pytest.mark.parametrize("fmt", ["pte", "onnx"])
def test_another_clients_file_is_refused_naming_its_owner(demo, fmt: str, tmp_path: Path) -> None:
    _, out, result = demo
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    shutil.copyfile(folder / f"client-0.{fmt}", folder / f"client-3.{fmt}")  # r 1/4 over r 1
    owners = sorted(e["client"] for e in result.clients if e[fmt]["file"] == f"client-0.{fmt}")

    with pytest.raises(ExportError) as info:
        load_exported(folder, 4, fmt)  # client 4 shares client 3's file

    assert str(info.value) == (
        f"export error: {folder / f'client-3.{fmt}'} is the {fmt} program of client(s) "
        f"{owners}, not client 4's (its SHA-256 differs from the manifest's record); export again"
    )


@needs_edge
def test_without_a_manifest_a_damaged_file_is_tried_in_a_child_process(
    demo, tmp_path: Path
) -> None:
    _, out, _ = demo
    # a program whose XNNPACK blob names a constant by an invalid UTF-8 key: ExecuTorch 1.5.1
    # aborts the process that loads it (pybind11 terminate). Here the child dies, not us.
    # Constants are keyed by SHA-256 hex names, first in the program's data map (damage there
    # is refused cleanly), then again inside the XNNPACK blob.
    data = bytearray((out / "client-3.pte").read_bytes())
    key = re.search(rb"[0-9a-f]{64}", bytes(data))
    assert key is not None
    data[bytes(data).index(key.group(), key.end())] = 0xCA
    damaged = tmp_path / "damaged.pte"
    damaged.write_bytes(bytes(data))
    with pytest.raises(ExportError) as info:
        load_program(damaged)
    assert str(info.value) == (
        f"export error: {damaged} crashed the ExecuTorch runtime (SIGABRT) in a child process: "
        "the file is damaged or not an ExecuTorch program"
    )

    # not a protobuf at all
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08" + b"\xff" * 64)
    with pytest.raises(ExportError, match=r"garbage\.onnx is not a loadable ONNX model"):
        load_program(garbage)


def test_a_child_killed_by_a_signal_is_reported_as_a_crash(monkeypatch, tmp_path: Path) -> None:
    path = tmp_path / "x.onnx"
    path.write_bytes(b"")
    monkeypatch.setattr(radbo.edge, "require", lambda fmt: None)
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -11, "", "")
    )

    with pytest.raises(ExportError) as info:
        load_program(path)

    assert str(info.value) == (
        f"export error: {path} crashed the ONNX Runtime (SIGSEGV) in a child process: the file "
        "is damaged or not an ONNX model"
    )


@needs_edge
def test_inputs_of_another_shape_are_refused_naming_the_file(demo) -> None:
    _, out, _ = demo
    program = load_exported(out, 0, "onnx")

    with pytest.raises(ExportError) as info:
        program(torch.zeros(2, 65))

    assert str(info.value) == (
        f"export error: {out / 'client-0.onnx'} takes float32 inputs of shape (batch, 64), got "
        "torch.float32 (2, 65): the file is not this model's submodel"
    )


@needs_edge
def test_a_batch_past_max_batch_is_refused_naming_max_batch(demo) -> None:
    # Arrange: the demo's programs, planned for batches of 1 to 32
    _, out, result = demo
    pte = load_exported(out, 0, "pte")
    batch = torch.randn(70, 64, generator=torch.Generator().manual_seed(0))
    assert result.clients[0]["pte"]["max_batch"] == pte.max_batch == 32
    assert "max_batch" in result.manifest["edge"]["max_batch_rule"]

    # Act
    with pytest.raises(ExportError) as info:
        pte(batch[:33])
    chunks = pte.run_batches(batch)

    # Assert: one line naming the bound and the way out, not ExecuTorch's "error 0x10"
    assert str(info.value) == (
        f"export error: {out / 'client-0.pte'} takes batches of at most max_batch = 32 "
        "(ExecuTorch plans the program's memory for that bound), got 33; split the batch "
        "(EdgeProgram.run_batches does) or export with a larger batch_size"
    )
    # run in chunks of 32, 32 and 6, each exactly what the program gives on that chunk
    assert chunks.shape == (70, 10)
    for start in (0, 32, 64):
        assert torch.equal(chunks[start : start + 32], pte(batch[start : start + 32]))


@needs_edge
def test_the_runtimes_own_refusal_says_what_the_bound_is(demo) -> None:
    # a program whose bound radbo was told wrongly: ExecuTorch itself refuses the batch
    _, out, _ = demo
    pte = load_exported(out, 0, "pte")
    pte.max_batch = 64

    with pytest.raises(ExportError) as info:
        pte(torch.zeros(33, 64))

    assert "failed with error 0x10" in str(info.value)
    assert str(info.value).endswith(
        "; the program was planned for batches of at most 32: a larger batch, or another input "
        "shape, is refused there"
    )
    assert "\n" not in str(info.value)


def test_native_runtime_noise_is_silenced_and_other_lines_kept(capfd) -> None:
    # what ExecuTorch's CPU probe writes to file descriptor 2, and a line that is not noise
    with radbo.edge._native_stderr():
        os.write(2, b"[cpuinfo_utils.cpp:71] Reading file /sys/devices/soc0/image_version\n")
        os.write(2, b"[cpuinfo_utils.cpp:125] CPU info and manual query on # of cpus dont match.\n")
        os.write(2, b"[method.cpp:1243] Error resizing tensor at input 0\n")

    captured = capfd.readouterr()
    assert captured.err == "[method.cpp:1243] Error resizing tensor at input 0\n"
    assert captured.out == ""


# ---------------------------------------------------------------- BatchNorm with running stats
@pytest.mark.float_sensitive
@needs_edge
@pytest.mark.parametrize("fmt", ["pte", "onnx"])
def test_batchnorm_programs_use_the_running_statistics(fmt: str) -> None:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(256, 3)
    )
    bn = model[1]
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(4, generator=gen))
        bn.running_var.copy_(0.5 + torch.rand(4, generator=gen))
        bn.weight.copy_(1 + 0.3 * torch.randn(4, generator=gen))
    model.train()  # lower() takes an eval copy; the caller's module keeps its mode
    inputs = torch.randn(8, 1, 8, 8, generator=gen)

    lowered = lower(model, inputs, fmt, max_batch=8)
    got = EdgeProgram.from_bytes(fmt, lowered.data)(inputs)

    assert model.training
    with torch.no_grad():
        want = model.eval()(inputs)
    # float32 against float32 in other kernels: the derived bound is 6.4e-4 here (276
    # roundings through conv, BatchNorm and head, |net|(|x|) <= 19.5); measured 2.7e-7 /
    # 3.1e-7 / 3.0e-7 (default/avx2/avx512), the bound 2000x above
    bound = logit_rounding_bound(model, inputs)
    assert bound < 0.01 * float(want.abs().max())  # a bound that still sees a wrong statistic
    assert _max_diff(got, want) <= bound
    single = EdgeProgram.from_bytes(fmt, lowered.data)(inputs[:1])  # per example, not per batch
    assert _max_diff(single, want[:1]) <= bound


@pytest.mark.float_sensitive
@needs_edge
def test_cnn_with_batchnorm_exports_every_capacity(tmp_path: Path) -> None:
    config = _config(model={"name": "cnn", "channels": [4, 8]})

    export_submodels(config, tmp_path, formats="onnx", latency_runs=0)

    manifest = _assert_round_trips(config, tmp_path, ("onnx",))
    assert {e["capacity"] for e in manifest["clients"]} == {1.0, 0.5, 0.25}
    assert not list(tmp_path.glob("*.safetensors"))  # formats chose onnx only
    assert all(e["file"] is None and e["pte"] is None for e in manifest["clients"])
    assert all(e["onnx"]["latency"] == [] for e in manifest["clients"])


# ---------------------------------------------------------------- CLI and calibration
@pytest.mark.float_sensitive
@needs_edge
def test_cli_export_writes_the_formats_asked_for(tmp_path: Path, capsys) -> None:
    config = tmp_path / "small.toml"
    config.write_text(SMALL_TOML)

    code = main(
        [
            "export",
            str(config),
            "--format",
            "onnx",
            "--latency-runs",
            "1",
            "--output",
            str(tmp_path / "o"),
        ]
    )

    out = capsys.readouterr().out
    assert code == 0 and "check passed" in out
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == [
        "client-0.onnx",
        "client-1.onnx",
        "manifest.json",
    ]
    # the runtime table: per submodel its accuracy in PyTorch and ONNX Runtime and latency
    manifest = read_manifest(tmp_path / "o")
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("submodel      PyTorch"))
    assert lines[head].split() == ["submodel", "PyTorch", "ORT", "%", "ORT", "us"]
    for row, first in zip(lines[head + 1 : head + 3], (0, 1), strict=True):
        accuracy = manifest["clients"][first]["accuracy"]
        latency = manifest["clients"][first]["onnx"]["latency"][-1]["per_sample_s"]
        assert row.split() == [
            f"client-{first}",
            f"{100 * accuracy['pytorch']:.2f}",
            f"{100 * accuracy['onnx']:.2f}",
            f"{latency * 1e6:.1f}",
        ]
    assert all(len(line) <= 100 or "/" in line for line in lines)
    assert main(["export", str(config), "--format", "tflite", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "export error: format 'tflite' is not one radbo writes; use a comma-separated list of "
        "safetensors, pte, onnx\n"
    )


@needs_edge
def test_fleet_calibrate_compares_the_flop_model_with_the_runtimes(
    monkeypatch, tmp_path: Path, capsys
) -> None:
    # Arrange: a host profile with a round compute rate, so predictions are exact
    host = parse_profile(
        {
            "name": "host",
            "tier": "host",
            "compute_flops": 1e9,
            "memory_bytes": 2**30,
            "uplink_bps": 1e8,
            "downlink_bps": 1e8,
        }
    )
    monkeypatch.setattr("radbo.devices.probe_host", lambda: host)
    config = tmp_path / "small.toml"
    config.write_text(SMALL_TOML)

    results = []

    def recording(*args, **kwargs):
        results.append(calibrate(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr("radbo.export.calibrate", recording)

    # Act
    assert main(["fleet", "--calibrate", str(config), "--runs", "1"]) == 0
    table = capsys.readouterr().out
    report = json.loads(json.dumps(results[0].to_dict()))  # what --json prints

    # Assert: MLP 64-16-10 at r = 1 and its leading half 64-8-10, per sample
    rows = report["rows"]
    assert [(r["capacity"], r["format"]) for r in rows] == [
        (1.0, "pte"),
        (1.0, "onnx"),
        (0.5, "pte"),
        (0.5, "onnx"),
    ]
    for row in rows:
        hidden = 16 if row["capacity"] == 1.0 else 8
        assert row["forward_flops_per_sample"] == 2 * 64 * hidden + 2 * hidden * 10
        # + backward: head weight and input gradients, first layer weight gradient
        assert row["train_step_flops_per_sample"] == 316 * hidden
        assert row["predicted_s_per_sample"] == row["forward_flops_per_sample"] / 1e9
        assert row["ratio"] == row["measured_s_per_sample"] / row["predicted_s_per_sample"]
        assert row["measured_s_per_sample"] > 0 and row["batch"] == 32
        assert row["train_step_predicted_s_per_sample"] == (
            row["train_step_flops_per_sample"] / 1e9
        )
    assert report["host"]["compute_flops"] == 1e9 and report["runs"] == 1
    assert "predicted = forward FLOPs per sample / compute_flops" in table
    assert "ratio = measured / predicted" in table
    assert " 2.368 " in table  # r = 1: 2368 FLOPs per sample at 1 GFLOP/s, in microseconds
    assert table.count("ExecuTorch/XNNPACK") == 2 and table.count("ONNX Runtime") == 2


def test_forward_flops_count_the_forward_pass_only() -> None:
    from radbo.models import MLP

    assert forward_flops(MLP(64, [16], 10), 32) == 32 * (2 * 64 * 16 + 2 * 16 * 10)


def test_calibrate_refuses_formats_that_are_not_programs() -> None:
    with pytest.raises(ExportError, match="formats must be among pte, onnx, got safetensors"):
        calibrate(_config(), formats="safetensors")


# ---------------------------------------------------------------- the zoo (slow)
ZOO = {
    "mlp": {"model": {"name": "mlp", "hidden": [16]}},
    "cnn": {"model": {"name": "cnn", "channels": [4, 8]}},
    "cnn7": {
        "data": {"name": "digits", "image_size": 16},
        "model": {"name": "cnn7", "channels": [4, 8], "hidden": [16, 8]},
    },
    "conv4": {
        "partition": {"kind": "iid"},
        "model": {"name": "conv4", "width": 8},
        "task": {"name": "few_shot", "ways": 5, "shots": 1, "queries": 3, "test_episodes": 20},
    },
    "resnet12": {
        "partition": {"kind": "iid"},
        "data": {"name": "digits", "image_size": 16},
        "model": {"name": "resnet12", "widths": [4, 8, 8, 8]},
        "task": {"name": "few_shot", "ways": 5, "shots": 1, "queries": 3, "test_episodes": 20},
    },
    "resnet18": {
        "data": {"name": "digits", "image_size": 16},
        "model": {"name": "resnet18", "widths": [4, 8, 8, 8]},
    },
    "logistic": {
        "model": {"name": "logistic"},
        "task": {"name": "feature_l2", "inner_l2": 0.001},
        "mask": {"policy": "none"},
    },
    "vs_mlp": {
        "model": {"name": "vs_mlp", "hidden": [16]},
        "task": {"name": "vs_loss", "inner_l2": 0.001},
    },
}


@pytest.mark.float_sensitive
@needs_edge
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ZOO))
def test_every_zoo_model_round_trips_at_every_capacity(name: str, tmp_path: Path) -> None:
    config = _config(**ZOO[name])

    result = export_submodels(config, tmp_path, formats="pte,onnx", latency_runs=1)

    manifest = _assert_round_trips(config, tmp_path, ("pte", "onnx"))
    assert result.passed
    assert {e["capacity"] for e in manifest["clients"]} == {1.0, 0.5, 0.25}
    if name == "logistic":  # x is not in the forward pass, the head keeps its outputs
        assert manifest["submodels"] == 1
    else:
        assert manifest["submodels"] == 3


def test_each_edge_format_is_one_registered_program_class():
    """A format is one EdgeProgram subclass (how it lowers, loads and runs, what its runtime
    is called): no branch on the format's name anywhere in radbo.edge."""
    import radbo.edge as edge

    assert EDGE_FORMATS == ("pte", "onnx") == tuple(edge._PROGRAMS)
    assert edge.program_kind("pte") is edge.PteProgram
    assert edge.program_kind("onnx") is edge.OnnxProgram
    assert edge.PteProgram.quantizations == edge.QUANTIZATIONS
    assert edge.OnnxProgram.quantizations == ()
    with pytest.raises(ExportError, match="'tflite' is not an edge format"):
        edge.program_kind("tflite")
    source = Path(edge.__file__).read_text()
    assert not re.search(r"""\b(fmt|format)\s*[!=]=\s*["']""", source)
