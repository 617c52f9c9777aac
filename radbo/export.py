"""Python API of ``radbo export``: the pruned submodel each client of a fleet trains in round 0.

:func:`export_submodels` builds the run of a config exactly as ``radbo run`` does
(:func:`radbo.experiment.build`), asks its :class:`~radbo.masks.assigner.SubmodelAssigner` for
every client's round-0 index set (with the simulation's own per-client generators, so the
channels are the ones the run picks), and writes to the output folder:

- one ``client-<i>.safetensors`` per **distinct submodel**: clients whose policy keeps the same
  channels share one file, named after the first of them (``i``); each client's ``file`` in the
  manifest names the file it must load. The tensors are ``extract(initial global model,
  index set)``: the state dict of ``StructurePlan.submodel(index_set)`` at initialisation;
- with ``torch_export=True``, ``client-<i>.pt2`` next to it: ``torch.export`` of the
  submodel's forward (batch dimension dynamic when it can be), or the error text in the
  manifest if ``torch.export`` cannot take the model;
- with ``formats`` naming ``pte`` / ``onnx`` (the optional extra ``radbo[edge]``), per
  distinct submodel an ExecuTorch program ``client-<i>.pte`` (XNNPACK-delegated, FP32) and / or
  an ONNX model ``client-<i>.onnx`` (see :mod:`radbo.edge`), and with ``quantize="int8"`` an
  int8 program ``client-<i>.int8.pte`` next to the FP32 one. A runtime that cannot take a
  model leaves the error text in the manifest instead of the file;
- ``manifest.json`` (written last): per client its device, tier, capacity r, local steps, the
  file, parameter count, kept indices per tensor and dimension, FLOPs of one training step,
  bytes of the submodel and of its index metadata, the check below and, per edge format, the
  file, its bytes and SHA-256, the check's ``max_abs_diff`` and the latency measured in the
  runtime (median of ``latency_runs`` runs at batch 1 and at the training batch size).

**The export checks what it writes.** Each safetensors file is read back, compared bitwise
with ``extract(full, index_set)`` and loaded into a fresh ``plan.submodel(index_set)``; its
logits on a fixed batch (the first test examples) must equal those of the full model whose
tensors are zeroed outside the mask (the equivalence ``tests/test_masks.py`` proves), within
``tolerance``. Each ``.pt2`` is loaded back and compared with the submodel the same way. Each
``.pte`` / ``.onnx`` is read back from disk and run **in its own runtime**
(``executorch.runtime.Runtime``, ``onnxruntime.InferenceSession``), and its output on the same
batch is compared with the masked full model's within ``tolerance``. Any failure raises
:class:`ExportCheckError` after everything (manifest included) is written. The int8 program is
not held to the tolerance (quantization changes the outputs by design): the manifest reports its
largest difference, the test accuracy of the FP32 and int8 submodels and their top-1 agreement.
These are the round-0 weights, i.e. the initial model: accuracy there is near chance, so the
agreement is the telling figure.

:func:`load_exported` loads one client's exported program back, checking the file's size and
SHA-256 against the manifest first (a truncated file, or another client's, is refused with one
line naming it). :func:`calibrate` (``radbo fleet --calibrate``) compares the simulator's
FLOP-based time model for this host with the latency the runtimes measure.

**Round 0.** ``prepare`` is called with *every* client, so clients not available (or not
sampled) in round 0 are exported too. For the policies whose choice for a client does not
depend on which other clients take part (``leading``, ``rolling``, ``random``, ``importance``,
``none``) the exported masks are exactly those a run's round 0 assigns to every client that
takes part in it. ``coverage`` forms its teams from the round's clients, so when availability
or ``clients_per_round`` leave some out of round 0 a participant's round-0 mask can differ
from the exported one. The manifest says, per client, whether it takes part in round 0 and
whether its exported mask is the one round 0 gives it (``round0``).
"""

from __future__ import annotations

import copy
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn
from torch.func import functional_call

from radbo.checkpoint import atomic_write, atomic_write_text
from radbo.client import ClientBudget
from radbo.config import RunConfig
from radbo.cost import index_metadata_bytes, tensor_bytes
from radbo.devices.profile import DeviceProfile
from radbo.edge import (
    EDGE_FORMATS,
    LATENCY_RUNS,
    QUANTIZATIONS,
    EdgeProgram,
    ExportError,
    batch_of,
    digest,
    first_line,
    load_program,
    lower,
    measure_latency,
    parse_formats,
    require,
)
from radbo.experiment import Experiment, build
from radbo.flops import count_flops, meta_training_inputs, training_step_flops
from radbo.masks.assigner import SubmodelAssigner
from radbo.masks.index import dense_mask, extract
from radbo.masks.policies import RoundPreparedPolicy
from radbo.masks.structure import StructurePlan
from radbo.typing import IndexSet, Params

__all__ = [
    "FORMAT",
    "TOLERANCE",
    "Calibration",
    "CalibrationRow",
    "ExportCheckError",
    "ExportError",
    "ExportResult",
    "calibrate",
    "export_submodels",
    "forward_flops",
    "load_exported",
    "round0_assignment",
]

FORMAT = "radbo-export/1"
#: Largest |submodel - masked full model| allowed on the check batch.
TOLERANCE = 1e-5
#: Examples (the first of the test set) in the check batch.
CHECK_BATCH = 32
#: Training examples the int8 quantizer observes (the first of the training set).
CALIBRATION_EXAMPLES = 256


class ExportCheckError(RuntimeError):
    """A written submodel does not reproduce the masked full model. ``result`` holds what was
    written (the manifest records every client's ``max_abs_diff``)."""

    def __init__(self, message: str, result: ExportResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class ExportResult:
    """What :func:`export_submodels` wrote.

    Attributes:
        out_dir: the output folder.
        manifest_path: ``out_dir / "manifest.json"``.
        manifest: the manifest as written.
        files: every file written (safetensors, ``.pt2``, the manifest).
        max_abs_diff: the largest difference found by the check, over all clients.
        passed: whether every check stayed within the tolerance.
    """

    out_dir: Path
    manifest_path: Path
    manifest: dict[str, Any]
    files: list[Path] = field(default_factory=list)
    max_abs_diff: float = 0.0
    passed: bool = True

    @property
    def clients(self) -> list[dict[str, Any]]:
        """The manifest's per-client entries."""
        return self.manifest["clients"]


def round0_assignment(
    experiment: Experiment,
) -> tuple[StructurePlan, list[IndexSet], list[ClientBudget]]:
    """Structure plan, index set and budget of every client of ``experiment`` in round 0, as
    ``Simulation.step`` assigns them, with ``prepare`` called on all clients (see the module
    docstring for when that can differ from a run's round 0)."""
    sim = experiment.simulation
    clients = list(range(len(sim.clients)))
    budgets = sim.round_budgets(0, clients)
    if sim.masks is None:
        model = experiment.model
        plan = StructurePlan(model, model.example_input(1), output_layers=model.output_layers)
        return plan, [plan.full_index_set() for _ in clients], budgets
    assert isinstance(sim.masks, SubmodelAssigner), "build() gives a SubmodelAssigner"
    index_sets = sim.round_index_sets(experiment.initial_state, 0, clients, budgets)
    return sim.masks.plan, index_sets, budgets


def _key(index_set: IndexSet) -> tuple:
    return tuple(
        (name, tuple(None if e is None else tuple(e.tolist()) for e in entry))
        for name, entry in sorted(index_set.items())
    )


def _masked_full_logits(
    plan: StructurePlan, state: Params, index_set: IndexSet, inputs: Tensor
) -> Tensor:
    """Logits of the full model with every tensor zeroed outside ``index_set``, restricted to
    the kept outputs (eval mode)."""
    model = copy.deepcopy(plan.model)
    masks = dense_mask(index_set, plan.shapes)
    model.load_state_dict(
        {k: torch.where(masks[k], v, torch.zeros_like(v)) for k, v in state.items()}
    )
    model.eval()
    with torch.no_grad():
        out = model(inputs)
    head = f"{plan.output_layers[-1]}.weight" if plan.output_layers else None
    kept = None if head is None or head not in index_set else index_set[head][0]
    return out if kept is None else out.index_select(1, kept)


def _diff(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _torch_export(sub: nn.Module, inputs: Tensor) -> tuple[bytes, bool]:
    """Serialized ``torch.export`` program of ``sub``'s forward: batch dimension dynamic when
    ``torch.export`` can, else static at the check batch's size."""
    try:
        batch = torch.export.Dim("batch")
        program = torch.export.export(sub, (inputs,), dynamic_shapes=({0: batch},))
        dynamic = True
    except Exception:  # fall back to a static batch size; a second failure is reported
        program = torch.export.export(sub, (inputs,))
        dynamic = False
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue(), dynamic


def _write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda tmp: tmp.write_bytes(data))


def _prepare_folder(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ExportError(
            f"export error: cannot create output folder {out}: {err.strerror or err}"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ExportError(f"export error: output folder {out} is not writable")


def _edge_options(
    formats: str | Sequence[str], quantize: str | None, latency_runs: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(all formats, edge formats) after checking the options and the packages they need."""
    chosen = parse_formats(formats)
    edge = tuple(f for f in chosen if f in EDGE_FORMATS)
    if quantize is not None:
        if quantize not in QUANTIZATIONS:
            raise ExportError(
                f"export error: quantize = {quantize!r} is not offered; use "
                f"{', '.join(QUANTIZATIONS)} (an int8 .pte program)"
            )
        if "pte" not in edge:
            raise ExportError(
                "export error: quantize = 'int8' quantizes the .pte program; add pte to the "
                "formats (e.g. --format safetensors,pte)"
            )
    if isinstance(latency_runs, bool) or not isinstance(latency_runs, int) or latency_runs < 0:
        raise ExportError(
            f"export error: latency_runs = {latency_runs!r}: must be an integer >= 0 "
            "(0: no latency measurement)"
        )
    for fmt in edge:
        require(fmt)
    return chosen, edge


@dataclass
class _Submodel:
    """One distinct round-0 submodel: its index set and the clients that train it."""

    index_set: IndexSet
    clients: list[int]

    @property
    def first(self) -> int:
        return self.clients[0]


def _distinct(index_sets: Sequence[IndexSet]) -> dict[tuple, _Submodel]:
    groups: dict[tuple, _Submodel] = {}
    for c, idx in enumerate(index_sets):
        key = _key(idx)
        if key in groups:
            groups[key].clients.append(c)
        else:
            groups[key] = _Submodel(idx, [c])
    return groups


def _state(experiment: Experiment) -> Params:
    sim = experiment.simulation
    return {
        k: v.detach().clone()
        for k, v in sim.algorithm.model_state(experiment.initial_state).items()
    }


def export_submodels(
    config: RunConfig,
    out_dir: str | Path,
    *,
    formats: str | Sequence[str] = ("safetensors",),
    torch_export: bool = False,
    quantize: str | None = None,
    latency_runs: int = LATENCY_RUNS,
    tolerance: float = TOLERANCE,
) -> ExportResult:
    """Write every client's round-0 submodel of ``config`` to ``out_dir`` and check it.

    See the module docstring for the files, the check and what "round 0" means here.

    Args:
        config: the run configuration (as for :func:`radbo.run`).
        out_dir: the output folder (created if needed).
        formats: which files to write per distinct submodel: ``"safetensors"`` (default),
            ``"pte"``, ``"onnx"``, as a sequence or a comma-separated string.
        torch_export: also write a ``torch.export`` program per distinct submodel.
        quantize: ``"int8"`` to write an int8 ``.pte`` next to the FP32 one (needs ``pte``).
        latency_runs: timed runs per latency figure of an edge program (default 20; 0: none).
        tolerance: the largest |submodel logits - masked full model logits| allowed.

    Returns:
        An :class:`ExportResult` whose ``manifest`` is what ``manifest.json`` holds.

    Raises:
        ConfigError, DeviceTooSmallError: the config cannot be built.
        ExportError: an option is invalid, a package an edge format needs is missing, or the
            output folder cannot be created or written.
        ExportCheckError: a written file does not reproduce the masked full model within
            ``tolerance`` (raised after the manifest is written).
    """
    chosen, edge = _edge_options(formats, quantize, latency_runs)
    out = Path(out_dir)
    _prepare_folder(out)
    exp = build(config)
    sim = exp.simulation
    model = exp.model
    full_state = _state(exp)
    plan, index_sets, budgets = round0_assignment(exp)
    clients = list(range(len(index_sets)))

    # Round 0 of a run: which clients take part, and the masks it gives them.
    sampled = sim.sample_clients(0)
    round0_sets = dict(zip(clients, index_sets, strict=True))
    # round0_assignment made sure that masks, when there are any, are a SubmodelAssigner
    masks = sim.masks
    if isinstance(masks, SubmodelAssigner) and isinstance(masks.policy, RoundPreparedPolicy):
        if sampled != clients:
            actual = sim.round_index_sets(
                exp.initial_state, 0, sampled, sim.round_budgets(0, sampled)
            )
            round0_sets = dict(zip(sampled, actual, strict=True))

    inputs = exp.test.features[:CHECK_BATCH].to(torch.float32)
    batch_size = int(config.algorithm.batch_size)
    outer, inner = set(model.outer_param_names()), set(model.inner_param_names())
    edge_setup = _EdgeSetup(
        edge=edge,
        quantize=quantize,
        runs=latency_runs,
        batches=sorted({1, batch_size}),
        max_batch=max(batch_size, int(inputs.shape[0]), 1),
        calibration=exp.train.features[:CALIBRATION_EXAMPLES].to(torch.float32),
        test_features=exp.test.features.to(torch.float32),
        test_labels=exp.test.labels,
    )

    groups = _distinct(index_sets)
    files: list[Path] = []
    per_submodel: dict[int, dict[str, Any]] = {}
    try:
        for group in groups.values():
            first, idx = group.first, group.index_set
            tensors = {k: v.contiguous() for k, v in extract(full_state, idx).items()}
            data = safetensors_bytes(
                tensors,
                metadata={"format": "pt", "producer": FORMAT, "clients": str(group.clients)},
            )
            name: str | None = None
            if "safetensors" in chosen:
                name = f"client-{first}.safetensors"
                _write_bytes(out / name, data)
                files.append(out / name)

            # the check: read back, compare bitwise, load into a fresh submodel, compare logits
            loaded = load_file(out / name) if name else safetensors_load(data)
            same_tensors = set(loaded) == set(tensors) and all(
                loaded[k].dtype == tensors[k].dtype and torch.equal(loaded[k], tensors[k])
                for k in tensors
            )
            sub = plan.submodel(idx)
            sub.load_state_dict(loaded, strict=True)
            sub.eval()
            with torch.no_grad():
                logits = sub(inputs)
            want = _masked_full_logits(plan, full_state, idx, inputs)
            diff = _diff(logits, want)
            if not same_tensors:
                diff = float("inf")

            entry: dict[str, Any] = {
                "file": name,
                "parameters": sum(p.numel() for p in sub.parameters()),
                "parameters_x": sum(p.numel() for n, p in sub.named_parameters() if n in outer),
                "parameters_y": sum(p.numel() for n, p in sub.named_parameters() if n in inner),
                "bytes": tensor_bytes(loaded),
                "index_metadata_bytes": index_metadata_bytes(idx),
                "flops_per_step": training_step_flops(sub, batch_size),
                "shapes": {k: list(v.shape) for k, v in loaded.items()},
                "kept": {
                    k: [None if e is None else [int(i) for i in e.tolist()] for e in dims]
                    for k, dims in idx.items()
                },
                "max_abs_diff": diff,
                "torch_export": None,
            }
            if torch_export:
                entry["torch_export"] = _export_program(sub, inputs, logits, out, first, files)
            for fmt in EDGE_FORMATS:
                entry[fmt] = None
                if fmt in edge:
                    entry[fmt] = _edge_file(sub, fmt, None, inputs, want, out, first, edge_setup)
            for q in QUANTIZATIONS:
                entry[f"pte_{q}"] = None
            if quantize is not None:
                entry[f"pte_{quantize}"] = _edge_file(
                    sub, "pte", quantize, inputs, want, out, first, edge_setup
                )
            files.extend(out / e["file"] for e in _edge_entries(entry) if e.get("file"))
            per_submodel[first] = entry
    except OSError as err:
        where = err.filename or out
        raise ExportError(f"export error: cannot write {where}: {err.strerror or err}") from None

    submodel_of = {c: g.first for g in groups.values() for c in g.clients}
    entries = []
    for c, budget in zip(clients, budgets, strict=True):
        first = submodel_of[c]
        shared = groups[_key(index_sets[first])].clients
        device = tier = None
        if exp.fleet is not None:
            profile = exp.fleet[c]
            device, tier = profile.name, profile.tier or profile.name
        in_round0 = c in round0_sets and c in sampled
        entries.append(
            {
                "client": c,
                "device": device,
                "tier": tier,
                "capacity": budget.capacity,
                "local_steps": budget.local_steps,
                "round0": {
                    "takes_part": c in sampled,
                    "mask_equal": (
                        _key(round0_sets[c]) == _key(index_sets[c]) if in_round0 else None
                    ),
                },
                "shared_with": [m for m in shared if m != c],
                **per_submodel[first],
            }
        )

    full_sub = plan.submodel(plan.full_index_set())
    worst = max((e["max_abs_diff"] for e in per_submodel.values()), default=0.0)
    for e in per_submodel.values():
        for checked in (e["torch_export"], e["pte"], e["onnx"]):
            if checked is not None and "max_abs_diff" in checked:
                worst = max(worst, checked["max_abs_diff"])
    failed = sorted(c for c in clients if not _passes(per_submodel[submodel_of[c]], tolerance))
    unsupported = [
        {"client": first, "format": fmt, "error": e[fmt]["error"]}
        for first, e in per_submodel.items()
        for fmt in (*EDGE_FORMATS, *(f"pte_{q}" for q in QUANTIZATIONS))
        if isinstance(e.get(fmt), dict) and "error" in e[fmt]
    ]
    from radbo.version import __version__

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "radbo_version": __version__,
        "torch_version": torch.__version__,
        "round": 0,
        "mask_policy": config.mask.policy,
        "batch_size": batch_size,
        "formats": list(chosen),
        "model": {
            "name": config.model.name,
            "class": type(model).__name__,
            "input_shape": list(getattr(model, "input_shape", ())),
            "output_layers": list(plan.output_layers),
            "outer": model.outer_param_names(),
            "inner": model.inner_param_names(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes": tensor_bytes(full_state),
            "flops_per_step": training_step_flops(full_sub, batch_size),
        },
        "edge": _edge_summary(edge_setup) if edge else None,
        "check": {
            "batch": list(inputs.shape),
            "tolerance": tolerance,
            "max_abs_diff": worst,
            "passed": not failed,
            "failed_clients": failed,
            "unsupported": unsupported,
        },
        "submodels": len(groups),
        "clients": entries,
        "config": config.model_dump(mode="json"),
    }
    manifest_path = out / "manifest.json"
    try:
        atomic_write_text(manifest_path, json.dumps(manifest, indent=2, allow_nan=True) + "\n")
    except OSError as err:
        raise ExportError(
            f"export error: cannot write {manifest_path}: {err.strerror or err}"
        ) from None
    files.append(manifest_path)
    result = ExportResult(
        out_dir=out,
        manifest_path=manifest_path,
        manifest=manifest,
        files=files,
        max_abs_diff=worst,
        passed=not failed,
    )
    if failed:
        raise ExportCheckError(
            f"export check failed: the submodels of clients {failed} differ from the masked "
            f"full model by up to {worst:.3g} (tolerance {tolerance:g}); see {manifest_path}",
            result,
        )
    return result


def _edge_entries(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The edge-format records of a manifest entry (``pte``, ``onnx``, ``pte_int8``)."""
    keys = (*EDGE_FORMATS, *(f"pte_{q}" for q in QUANTIZATIONS))
    return [entry[k] for k in keys if isinstance(entry.get(k), dict)]


def _passes(entry: dict[str, Any], tolerance: float) -> bool:
    """The submodel's own check, its ``.pt2`` and its FP32 edge programs within ``tolerance``
    (an edge format a runtime cannot take is recorded, not a failure)."""
    if not entry["max_abs_diff"] <= tolerance or not _pt2_ok(entry["torch_export"], tolerance):
        return False
    return all(_pt2_ok(entry[fmt], tolerance) for fmt in EDGE_FORMATS)


@dataclass
class _EdgeSetup:
    """What every edge file of one export shares."""

    edge: tuple[str, ...]
    quantize: str | None
    runs: int
    batches: list[int]
    max_batch: int
    calibration: Tensor
    test_features: Tensor
    test_labels: Tensor


def _edge_summary(setup: _EdgeSetup) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str) -> str | None:
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    return {
        "formats": list(setup.edge),
        "quantize": setup.quantize,
        "versions": {p: installed(p) for p in ("executorch", "onnx", "onnxruntime")},
        "threads": torch.get_num_threads(),
        "latency_runs": setup.runs,
        "latency_batches": setup.batches,
        "max_batch": setup.max_batch,
        "calibration_examples": int(setup.calibration.shape[0]) if setup.quantize else 0,
    }


def _edge_file(
    sub: nn.Module,
    fmt: str,
    quantize: str | None,
    inputs: Tensor,
    want: Tensor,
    out: Path,
    first: int,
    setup: _EdgeSetup,
) -> dict[str, Any]:
    """Lower ``sub`` to ``fmt``, write it, load the file back in its runtime and check it
    against the masked full model's logits ``want``; the record for the manifest."""
    name = f"client-{first}.{quantize + '.' if quantize else ''}{fmt}"
    try:
        lowered = lower(
            sub,
            inputs,
            fmt,
            max_batch=setup.max_batch,
            quantize=quantize,
            calibration=setup.calibration,
        )
    except ExportError:
        raise
    except Exception as err:  # the exporter cannot take this model: recorded, not raised
        return {"file": None, "error": first_line(err)}
    _write_bytes(out / name, lowered.data)
    record: dict[str, Any] = {
        "file": name,
        "bytes": len(lowered.data),
        "sha256": digest(lowered.data),
        "dynamic_batch": lowered.dynamic_batch,
        "max_batch": lowered.max_batch,
    }
    try:
        # read back from disk, vouched for by the digest of the bytes just produced
        program = load_program(out / name, fmt, size=record["bytes"], sha256=record["sha256"])
        got = program(inputs)
    except ExportError as err:  # the runtime refuses what its exporter wrote: recorded
        return {**record, "error": str(err)}
    if quantize is None:
        record["max_abs_diff"] = _diff(got, want)
    else:  # not held to the FP32 tolerance: reported against the FP32 submodel instead
        record["quantize"] = quantize
        record.update(_accuracy(sub, program, setup))
    bounded = lowered.max_batch or max(setup.batches)
    batches = setup.batches if lowered.dynamic_batch else [bounded]
    record["latency"] = [
        _latency(program, batch_of(inputs, b), setup.runs)
        for b in batches
        if setup.runs and b <= bounded
    ]
    return record


def _latency(program: EdgeProgram, inputs: Tensor, runs: int) -> dict[str, Any]:
    batch = int(inputs.shape[0])
    median = measure_latency(program, inputs, runs)
    return {"batch": batch, "runs": runs, "median_s": median, "per_sample_s": median / batch}


def _accuracy(sub: nn.Module, program: EdgeProgram, setup: _EdgeSetup) -> dict[str, Any]:
    """The int8 program against the FP32 submodel on the whole test set: largest difference,
    top-1 agreement and (when the test labels are the model's classes) both accuracies."""
    features, labels = setup.test_features, setup.test_labels
    step = program.max_batch or features.shape[0]
    with torch.no_grad():
        fp32 = sub(features)
    int8 = torch.cat([program(features[i : i + step]) for i in range(0, len(features), step)])
    record: dict[str, Any] = {
        "examples": int(features.shape[0]),
        "max_abs_diff_vs_fp32": _diff(int8, fp32),
        "top1_agreement": float((int8.argmax(1) == fp32.argmax(1)).double().mean()),
        "test_accuracy_fp32": None,
        "test_accuracy_int8": None,
        "accuracy_drop": None,
    }
    if labels.numel() and int(labels.max()) < fp32.shape[1]:  # few-shot tests other classes
        acc32 = float((fp32.argmax(1) == labels).double().mean())
        acc8 = float((int8.argmax(1) == labels).double().mean())
        record.update(test_accuracy_fp32=acc32, test_accuracy_int8=acc8, accuracy_drop=acc32 - acc8)
    return record


def _pt2_ok(entry: dict[str, Any] | None, tolerance: float) -> bool:
    """A ``torch_export`` entry passes when there is none, when torch.export could not take
    the model (recorded, not a failure), or when the loaded program matches."""
    if entry is None or "max_abs_diff" not in entry:
        return True
    return entry["max_abs_diff"] <= tolerance


def _export_program(
    sub: nn.Module, inputs: Tensor, logits: Tensor, out: Path, first: int, files: list[Path]
) -> dict[str, Any]:
    """Write ``client-<first>.pt2`` and check it; the error text if torch.export fails."""
    name = f"client-{first}.pt2"
    try:
        data, dynamic = _torch_export(sub, inputs)
    except Exception as err:  # any failure of torch.export is recorded, not raised
        return {"file": None, "error": first_line(err)}
    _write_bytes(out / name, data)
    files.append(out / name)
    # the check: load what was just serialized (our own bytes) and compare with the submodel
    program = torch.export.load(io.BytesIO(data))
    with torch.no_grad():
        again = program.module()(inputs)
    return {"file": name, "dynamic_batch": dynamic, "max_abs_diff": _diff(again, logits)}


# ---------------------------------------------------------------------------- loading back
def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """The ``manifest.json`` of an export folder (JSON; :class:`ExportError` when it is missing
    or not an export manifest)."""
    path = Path(out_dir) / "manifest.json"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ExportError(f"export error: cannot read {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ExportError(f"export error: {path} is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ExportError(f"export error: {path} is not a {FORMAT} manifest")
    return manifest


def load_exported(out_dir: str | Path, client: int, fmt: str = "pte") -> EdgeProgram:
    """Client ``client``'s exported program from the export folder ``out_dir``, loaded in its
    runtime after checking the file against the manifest.

    Args:
        out_dir: a folder :func:`export_submodels` wrote.
        client: the client's index.
        fmt: ``"pte"``, ``"onnx"`` or ``"pte_int8"``.

    Raises:
        ExportError: (one line naming the file) the manifest has no such program, the file is
            missing, truncated, damaged or another client's (its size or SHA-256 differs from
            the manifest's record), the runtime refuses it, or it takes other inputs than the
            manifest's model.
    """
    out = Path(out_dir)
    manifest = read_manifest(out)
    entries = {e.get("client"): e for e in manifest.get("clients", []) if isinstance(e, dict)}
    if client not in entries:
        raise ExportError(
            f"export error: {out / 'manifest.json'} has no client {client!r} "
            f"(clients 0 to {len(entries) - 1})"
        )
    record = entries[client].get(fmt)
    if not isinstance(record, dict) or not record.get("file"):
        why = f" ({record['error']})" if isinstance(record, dict) and "error" in record else ""
        raise ExportError(f"export error: client {client} has no {fmt} program in {out}{why}")
    name = str(record["file"])
    if Path(name).name != name:  # a manifest names files inside its own folder only
        raise ExportError(f"export error: {out / 'manifest.json'} names a file outside it: {name}")
    path = out / name
    runtime_format = fmt.split("_")[0]
    data = path.read_bytes() if path.is_file() else None
    if data is not None and digest(data) != record.get("sha256"):
        owners = sorted(
            e["client"]
            for e in entries.values()
            if isinstance(e.get(fmt), dict) and e[fmt].get("sha256") == digest(data)
        )
        if owners:
            raise ExportError(
                f"export error: {path} is the {fmt} program of client(s) {owners}, not client "
                f"{client}'s (its SHA-256 differs from the manifest's record); export again"
            )
    program = load_program(
        path, runtime_format, size=record.get("bytes"), sha256=record.get("sha256")
    )
    expected = tuple(int(s) for s in manifest.get("model", {}).get("input_shape", ()))
    if expected and program.input_shape != expected:
        raise ExportError(
            f"export error: {path} takes inputs of shape {program.input_shape}, the manifest's "
            f"model {expected}"
        )
    program.dynamic_batch = record.get("dynamic_batch", program.dynamic_batch)
    return program


# ---------------------------------------------------------------------------- calibration
def forward_flops(module: nn.Module, batch_size: int) -> int:
    """FLOPs of one forward pass of ``module`` on a batch of ``batch_size`` (the counting
    rules of :func:`radbo.flops.count_flops`; on the ``meta`` device, ``module`` untouched).

    >>> from radbo.models import MLP
    >>> forward_flops(MLP(4, [3], 2), 1)  # 2*4*3 + 2*3*2
    36
    """
    state, inputs, _ = meta_training_inputs(module, batch_size, trainable=[])

    def forward() -> None:
        with torch.no_grad():
            functional_call(module, state, (inputs,))

    return count_flops(forward)


@dataclass(frozen=True)
class CalibrationRow:
    """One distinct round-0 submodel in one runtime.

    Attributes:
        capacity: the capacity r of the clients that train it.
        clients: those clients.
        format: ``"pte"`` (ExecuTorch, XNNPACK) or ``"onnx"`` (ONNX Runtime).
        parameters: the submodel's parameter count.
        batch: the batch the latency was measured at (the training batch size).
        forward_flops_per_sample: forward FLOPs per example (:func:`forward_flops` / batch).
        predicted_s_per_sample: ``forward_flops_per_sample / host.compute_flops``: the
            simulator's time model applied to the forward pass the runtime runs.
        measured_s_per_sample: median runtime latency at ``batch``, divided by ``batch``.
        ratio: ``measured / predicted`` (> 1: the runtime is slower than the FLOP model says).
        train_step_flops_per_sample: FLOPs of one training step (forward + backward) per
            example, what the simulator's clock charges.
        train_step_predicted_s_per_sample: ``train_step_flops_per_sample / compute_flops``.
        error: why the runtime could not take the submodel (then no measurement).
    """

    capacity: float
    clients: list[int]
    format: str
    parameters: int
    batch: int
    forward_flops_per_sample: float
    predicted_s_per_sample: float
    measured_s_per_sample: float | None
    ratio: float | None
    train_step_flops_per_sample: float
    train_step_predicted_s_per_sample: float
    error: str | None = None


_RUNTIMES = {"pte": "ExecuTorch/XNNPACK", "onnx": "ONNX Runtime"}


@dataclass
class Calibration:
    """What :func:`calibrate` found: the host's profile, the settings and one row per
    submodel and runtime."""

    host: DeviceProfile
    batch_size: int
    threads: int
    runs: int
    rows: list[CalibrationRow]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``radbo fleet --calibrate --json``)."""
        from dataclasses import asdict

        return {
            "host": {
                "compute_flops": self.host.compute_flops,
                "source": self.host.source,
            },
            "batch_size": self.batch_size,
            "threads": self.threads,
            "runs": self.runs,
            "rows": [asdict(r) for r in self.rows],
        }

    def table(self) -> str:
        """The comparison as text: one line per submodel and runtime."""
        head = (
            f"host: compute_flops = {self.host.compute_flops / 1e9:.2f} GFLOP/s (probe_host: "
            f"FP32 torch.mm, {self.threads} thread{'s' if self.threads != 1 else ''}); "
            f"latency: median of {self.runs} runs at the training batch size {self.batch_size}, "
            "per sample\n"
            "predicted = forward FLOPs per sample / compute_flops (the simulator's time model); "
            "ratio = measured / predicted\n"
        )
        cols = (
            f"{'r':>6}  {'clients':>7}  {'runtime':<18}  {'params':>9}  {'kFLOP/sample':>12}  "
            f"{'predicted us':>12}  {'measured us':>11}  {'ratio':>7}  {'sim step us':>11}"
        )
        lines = [head + cols]
        for r in self.rows:
            seconds = r.measured_s_per_sample
            measured = "-" if seconds is None else f"{seconds * 1e6:.3f}"
            ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
            line = (
                f"{r.capacity:>6.4g}  {len(r.clients):>7}  {_RUNTIMES[r.format]:<18}  "
                f"{r.parameters:>9}  {r.forward_flops_per_sample / 1e3:>12.2f}  "
                f"{r.predicted_s_per_sample * 1e6:>12.3f}  {measured:>11}  {ratio:>7}  "
                f"{r.train_step_predicted_s_per_sample * 1e6:>11.3f}"
            )
            if r.error:
                line += f"  ({r.error})"
            lines.append(line)
        return "\n".join(lines)


def calibrate(
    config: RunConfig,
    *,
    formats: str | Sequence[str] = EDGE_FORMATS,
    runs: int = LATENCY_RUNS,
    profile: DeviceProfile | None = None,
) -> Calibration:
    """Compare the simulator's per-sample compute time on this host with real runtimes.

    For every distinct round-0 submodel of ``config`` (one per capacity for the
    ``leading`` / ``importance`` policies) and every runtime in ``formats``, the submodel is
    lowered in memory (nothing is written), loaded in its runtime and timed at the training
    batch size (median of ``runs`` runs, torch's thread count). The prediction is the
    simulator's: FLOPs per sample divided by the host profile's ``compute_flops``
    (``profile``, default :func:`radbo.devices.probe_host`, measured with the same threads).

    Raises:
        ConfigError, DeviceTooSmallError: the config cannot be built.
        ExportError: a format is not an edge format or its packages are missing.
    """
    from radbo.devices import probe_host

    chosen = parse_formats(formats)
    edge = [f for f in chosen if f in EDGE_FORMATS]
    if not edge or len(edge) != len(chosen):
        raise ExportError(
            f"export error: calibration runs edge programs; formats must be among "
            f"{', '.join(EDGE_FORMATS)}, got {', '.join(chosen)}"
        )
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ExportError(f"export error: runs = {runs!r}: must be an integer >= 1")
    for fmt in edge:
        require(fmt)
    exp = build(config)
    plan, index_sets, budgets = round0_assignment(exp)
    state = _state(exp)
    host = profile if profile is not None else probe_host()
    batch = int(config.algorithm.batch_size)
    inputs = exp.test.features[:CHECK_BATCH].to(torch.float32)
    timed = batch_of(inputs, batch)
    rows: list[CalibrationRow] = []
    for group in _distinct(index_sets).values():
        sub = plan.submodel(group.index_set, state)
        sub.eval()
        fwd = forward_flops(sub, batch) / batch
        step = training_step_flops(sub, batch) / batch
        common: dict[str, Any] = {
            "capacity": budgets[group.first].capacity,
            "clients": list(group.clients),
            "parameters": sum(p.numel() for p in sub.parameters()),
            "batch": batch,
            "forward_flops_per_sample": fwd,
            "predicted_s_per_sample": fwd / host.compute_flops,
            "train_step_flops_per_sample": step,
            "train_step_predicted_s_per_sample": step / host.compute_flops,
        }
        for fmt in edge:
            try:
                lowered = lower(sub, inputs, fmt, max_batch=max(batch, int(inputs.shape[0])))
                program = EdgeProgram.from_bytes(fmt, lowered.data, f"client-{group.first}.{fmt}")
                measured = measure_latency(program, timed, runs) / batch
            except ExportError:
                raise
            except Exception as err:  # a runtime that cannot take the model: recorded
                rows.append(
                    CalibrationRow(
                        **common,
                        format=fmt,
                        measured_s_per_sample=None,
                        ratio=None,
                        error=first_line(err),
                    )
                )
                continue
            rows.append(
                CalibrationRow(
                    **common,
                    format=fmt,
                    measured_s_per_sample=measured,
                    ratio=measured / common["predicted_s_per_sample"],
                )
            )
    rows.sort(key=lambda r: (-r.capacity, r.clients[0], EDGE_FORMATS.index(r.format)))
    return Calibration(host, batch, torch.get_num_threads(), runs, rows)
