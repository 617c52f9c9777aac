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
- ``manifest.json`` (written last): per client its device, tier, capacity r, local steps, the
  file, parameter count, kept indices per tensor and dimension, FLOPs of one training step,
  bytes of the submodel and of its index metadata, and the check below.

**The export checks what it writes.** Each safetensors file is read back, compared bitwise
with ``extract(full, index_set)`` and loaded into a fresh ``plan.submodel(index_set)``; its
logits on a fixed batch (the first test examples) must equal those of the full model whose
tensors are zeroed outside the mask (the equivalence ``tests/test_masks.py`` proves), within
``tolerance``. Each ``.pt2`` is loaded back and compared with the submodel the same way. Any
failure raises :class:`ExportCheckError` after everything (manifest included) is written.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn

from radbo.checkpoint import atomic_write, atomic_write_text
from radbo.client import ClientBudget
from radbo.config import RunConfig
from radbo.cost import index_metadata_bytes, tensor_bytes
from radbo.experiment import Experiment, build
from radbo.flops import training_step_flops
from radbo.masks.assigner import SubmodelAssigner
from radbo.masks.index import dense_mask, extract
from radbo.masks.policies import RoundPreparedPolicy
from radbo.masks.structure import StructurePlan
from radbo.typing import IndexSet, Params

__all__ = [
    "FORMAT",
    "TOLERANCE",
    "ExportCheckError",
    "ExportError",
    "ExportResult",
    "export_submodels",
    "round0_assignment",
]

FORMAT = "radbo-export/1"
#: Largest |submodel - masked full model| allowed on the check batch.
TOLERANCE = 1e-5
#: Examples (the first of the test set) in the check batch.
CHECK_BATCH = 32


class ExportError(ValueError):
    """The export cannot be written (e.g. the output folder is not writable); one line."""


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


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


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


def export_submodels(
    config: RunConfig,
    out_dir: str | Path,
    *,
    torch_export: bool = False,
    tolerance: float = TOLERANCE,
) -> ExportResult:
    """Write every client's round-0 submodel of ``config`` to ``out_dir`` and check it.

    See the module docstring for the files, the check and what "round 0" means here.

    Args:
        config: the run configuration (as for :func:`radbo.run`).
        out_dir: the output folder (created if needed).
        torch_export: also write a ``torch.export`` program per distinct submodel.
        tolerance: the largest |submodel logits - masked full model logits| allowed.

    Returns:
        An :class:`ExportResult` whose ``manifest`` is what ``manifest.json`` holds.

    Raises:
        ConfigError, DeviceTooSmallError: the config cannot be built.
        ExportError: the output folder cannot be created or written.
        ExportCheckError: a written file does not reproduce the masked full model within
            ``tolerance`` (raised after the manifest is written).
    """
    out = Path(out_dir)
    _prepare_folder(out)
    exp = build(config)
    sim = exp.simulation
    model = exp.model
    full_state = {
        k: v.detach().clone() for k, v in sim.algorithm.model_state(exp.initial_state).items()
    }
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

    groups: dict[tuple, list[int]] = {}
    for c, idx in zip(clients, index_sets, strict=True):
        groups.setdefault(_key(idx), []).append(c)

    files: list[Path] = []
    per_submodel: dict[int, dict[str, Any]] = {}
    try:
        for members in groups.values():
            first = members[0]
            idx = index_sets[first]
            name = f"client-{first}.safetensors"
            tensors = {k: v.contiguous() for k, v in extract(full_state, idx).items()}
            data = safetensors_bytes(
                tensors, metadata={"format": "pt", "producer": FORMAT, "clients": str(members)}
            )
            _write_bytes(out / name, data)
            files.append(out / name)

            # the check: read back, compare bitwise, load into a fresh submodel, compare logits
            loaded = load_file(out / name)
            same_tensors = set(loaded) == set(tensors) and all(
                loaded[k].dtype == tensors[k].dtype and torch.equal(loaded[k], tensors[k])
                for k in tensors
            )
            sub = plan.submodel(idx)
            sub.load_state_dict(loaded, strict=True)
            sub.eval()
            with torch.no_grad():
                logits = sub(inputs)
            diff = _diff(logits, _masked_full_logits(plan, full_state, idx, inputs))
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
            per_submodel[first] = entry
    except OSError as err:
        where = err.filename or out
        raise ExportError(f"export error: cannot write {where}: {err.strerror or err}") from None

    submodel_of = {c: members[0] for members in groups.values() for c in members}
    entries = []
    for c, budget in zip(clients, budgets, strict=True):
        first = submodel_of[c]
        shared = groups[_key(index_sets[first])]
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
        te = e["torch_export"]
        if te is not None and "max_abs_diff" in te:
            worst = max(worst, te["max_abs_diff"])
    failed = sorted(
        c
        for c in clients
        if not per_submodel[submodel_of[c]]["max_abs_diff"] <= tolerance
        or not _pt2_ok(per_submodel[submodel_of[c]]["torch_export"], tolerance)
    )
    from radbo.version import __version__

    manifest: dict[str, Any] = {
        "format": FORMAT,
        "radbo_version": __version__,
        "torch_version": torch.__version__,
        "round": 0,
        "mask_policy": config.mask.policy,
        "batch_size": batch_size,
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
        "check": {
            "batch": list(inputs.shape),
            "tolerance": tolerance,
            "max_abs_diff": worst,
            "passed": not failed,
            "failed_clients": failed,
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
        return {"file": None, "error": _first_line(err)}
    _write_bytes(out / name, data)
    files.append(out / name)
    # the check: load what was just serialized (our own bytes) and compare with the submodel
    program = torch.export.load(io.BytesIO(data))
    with torch.no_grad():
        again = program.module()(inputs)
    return {"file": name, "dynamic_batch": dynamic, "max_abs_diff": _diff(again, logits)}
