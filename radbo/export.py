"""Python API of ``radbo export``: the pruned submodel each client of a fleet trains, from the
initial model (round 0) or from a model radbo has trained (a finished run, a checkpoint).

What is exported:

- :func:`export_submodels` ``(config, out_dir)``: the run's initial global model with the masks
  its round 0 gives each client;
- :func:`export_submodels` ``(config, out_dir, checkpoint=PATH)``: the state of a checkpoint
  the run wrote (any of ``<run>/checkpoints/run`` or ``<run>/checkpoints/final``), read through
  :func:`radbo.checkpoint.load_checkpoint` (SHA-256, finite tensors, the config it was written
  by equal to ``config`` except ``rounds``, ``output_dir`` and ``checkpoint_every``), with the
  masks the run's policy gives each client for that state: those of round ``R``, the round the
  run would go on with after the checkpoint's ``R`` rounds (``importance`` scores the trained
  weights, ``rolling`` turns with ``R``, every per-client generator is round ``R``'s);
- :func:`export_run` ``(run_dir, out_dir)``: a finished run's final state. ``radbo run`` writes
  it as a verified checkpoint to ``<run>/checkpoints/final`` (or, with ``checkpoint_every``,
  its checkpoint after the last round is in ``<run>/checkpoints/run``); the config is the one
  ``results.json`` records.

The export builds the run of the config exactly as ``radbo run`` does
(:func:`radbo.experiment.build`, on the CPU), asks its
:class:`~radbo.masks.assigner.SubmodelAssigner` for every client's index set with the
simulation's own per-client generators, and writes to the output folder:

- one ``client-<i>.safetensors`` per **distinct submodel**: clients whose policy keeps the same
  channels share one file, named after the first of them (``i``); each client's ``file`` in the
  manifest names the file it must load. The tensors are ``extract(state, index set)``: the state
  dict of ``StructurePlan.submodel(index_set)``. With static BatchNorm (``batchnorm =
  "static"``) the running statistics are first recomputed for each submodel over the server's
  calibration set, as the run's evaluation does for the global model;
- with ``torch_export=True``, ``client-<i>.pt2`` next to it: ``torch.export`` of the
  submodel's forward (batch dimension dynamic when it can be), or the error text in the
  manifest if ``torch.export`` cannot take the model;
- with ``formats`` naming ``pte`` / ``onnx`` (the optional extra ``radbo[edge]``), per
  distinct submodel an ExecuTorch program ``client-<i>.pte`` (XNNPACK-delegated, FP32) and / or
  an ONNX model ``client-<i>.onnx`` (see :mod:`radbo.edge`), and with ``quantize="int8"`` an
  int8 program ``client-<i>.int8.pte`` next to the FP32 one, calibrated on
  :data:`CALIBRATION_EXAMPLES` examples of the run's training set (a seeded sample, the server's
  calibration set of :func:`radbo.data.calibration_set`). A runtime that cannot take a model
  leaves the error text in the manifest instead of the file;
- ``manifest.json`` (written last), see the README's "Exporting submodels".

**The export checks what it writes.** Each safetensors file is read back, compared bitwise
with ``extract(state, index_set)`` and loaded into a fresh ``plan.submodel(index_set)``; its
logits on a fixed batch (the first :data:`CHECK_BATCH` test examples) must equal those of the
full model whose tensors are zeroed outside the mask (the equivalence ``tests/masks/test_masks.py``
proves) within the tolerance. Each ``.pt2`` is loaded back and compared the same way. Each
``.pte`` / ``.onnx`` is read back from disk and run **in its own runtime**
(``executorch.runtime.Runtime``, ``onnxruntime.InferenceSession``) and compared the same way.
The tolerance is not a number read off one CPU: it is :func:`logit_rounding_bound`, the
largest difference two float32 evaluations of the network that sum in different orders can
show, derived from float32's unit roundoff and the network's weights and operation count, so
a check fails only when something is wrong (a wrong channel, a wrong statistic), never
because another CPU's kernels round differently. Any failure raises :class:`ExportCheckError`
after everything (manifest included) is written. The int8 program is not held to it
(quantization changes the outputs by design).

**Accuracy.** Each distinct submodel's test accuracy is measured in PyTorch and in every
runtime it was written for (ExecuTorch, ONNX Runtime, int8 ExecuTorch), on the first
``accuracy_examples`` (default :data:`ACCURACY_EXAMPLES`) examples of the run's test set; the
manifest records the sample's size, and for int8 its drop against the FP32 submodel in PyTorch.
Tasks whose test set holds other classes than the model's outputs (``few_shot``: a fitted head
per episode) record no accuracy.

:func:`load_exported` loads one client's exported program back, checking the file's size and
SHA-256 against the manifest first (a truncated file, or another client's, is refused with one
line naming it). :func:`calibrate` (``radbo fleet --calibrate``) compares the simulator's
FLOP-based time model for this host with the latency the runtimes measure.

**Which round's masks.** ``prepare`` is called with *every* client, so clients not available
(or not sampled) in the round are exported too. For the policies whose choice for a client does
not depend on which other clients take part (``leading``, ``rolling``, ``random``,
``importance``, ``none``) the exported masks are exactly those the run's round ``R`` assigns to
every client that takes part in it. ``coverage`` forms its teams from the round's clients, so
when availability or ``clients_per_round`` leave some out of the round a participant's mask can
differ from the exported one. The manifest says, per client, whether it takes part in round
``R`` and whether its exported mask is the one that round gives it (``in_round``).
"""

from __future__ import annotations

import copy
import io
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes
from torch import Tensor, nn
from torch.func import functional_call

from radbo.atomic import atomic_write, atomic_write_text
from radbo.checkpoint import (
    has_checkpoint,
    load_checkpoint,
)
from radbo.client import ClientBudget
from radbo.config import ConfigError, RunConfig, parse_config
from radbo.cost import index_metadata_bytes, tensor_bytes
from radbo.data import calibration_set
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
from radbo.experiment.clientside import structure_plan
from radbo.flops import count_flops, meta_training_inputs, training_step_flops
from radbo.jsonio import dumps as json_dumps
from radbo.masks.assigner import SubmodelAssigner
from radbo.masks.index import dense_mask, extract
from radbo.masks.policies import RoundPreparedPolicy
from radbo.masks.structure import StructurePlan
from radbo.simulation import RUN_CHECKPOINT
from radbo.typing import IndexSet, Params

__all__ = [
    "ACCURACY_EXAMPLES",
    "CALIBRATION_EXAMPLES",
    "CHECK_BATCH",
    "FORMAT",
    "Calibration",
    "CalibrationRow",
    "ExportCheckError",
    "ExportError",
    "ExportResult",
    "ExportSource",
    "RoundingBound",
    "calibrate",
    "export_run",
    "export_submodels",
    "export_table",
    "find_final_checkpoint",
    "forward_flops",
    "load_exported",
    "load_source",
    "logit_rounding_bound",
    "read_manifest",
    "read_run_config",
    "round0_assignment",
    "round_assignment",
    "rounding_bound",
]

FORMAT = "radbo-export/2"
#: Examples (the first of the test set) in the check batch.
CHECK_BATCH = 32
#: Training examples the int8 quantizer observes (a seeded sample of the training set).
CALIBRATION_EXAMPLES = 256
#: Test examples (the first of the test set) each submodel's accuracy is measured on, per
#: runtime; the manifest records how many were used.
ACCURACY_EXAMPLES = 10_000
#: The largest ``results.json`` / ``manifest.json`` read (bytes); a larger file is refused.
MAX_JSON_BYTES = 1 << 30
#: Config keys a checkpoint may differ in from the config it is exported with (those a resumed
#: run may change: the target length, where it writes, how often, what it logs besides
#: results.json).
CHECKPOINT_IGNORES = ("rounds", "output_dir", "checkpoint_every", "logging")
#: Test examples per forward pass when measuring accuracy in PyTorch.
_EVAL_BATCH = 1024


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
        files: every file written (safetensors, ``.pt2``, edge programs, the manifest).
        max_abs_diff: the largest difference found by the check, over all clients.
        passed: whether every check stayed within its tolerance.
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

    def table(self, width: int = 100) -> str:
        """The export as text (what ``radbo export`` prints): :func:`export_table`."""
        return export_table(self.manifest, width=width)


# ---------------------------------------------------------------------------- the tolerance
@dataclass(frozen=True)
class RoundingBound:
    """What :func:`rounding_bound` derived.

    Attributes:
        bound: the largest |difference| two float evaluations of the network can show.
        roundings: ``k``, the roundings charged on the longest path (every layer's count).
        magnitude: the largest logit of ``|net|(|x|)`` (the network with absolute weights).
        largest_logit: the largest |logit| of the network itself on the inputs.
        dtype: the floating-point type whose unit roundoff ``u`` the bound uses.
    """

    bound: float
    roundings: int
    magnitude: float
    largest_logit: float
    dtype: str

    @property
    def informative(self) -> bool:
        """Whether the bound is below 1 % of the largest logit, so that a wrong channel (which
        moves logits by a sizeable part of them) still fails the check. Deep networks (the
        zoo's ResNets) have a worst case that aligns every rounding through 20 layers of
        ``|W|``: far above their logits, so the check can then only catch gross errors."""
        return self.bound < 0.01 * self.largest_logit

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the manifest's ``check.derivation``)."""
        return {
            "bound": self.bound,
            "roundings": self.roundings,
            "magnitude": self.magnitude,
            "largest_logit": self.largest_logit,
            "unit_roundoff": torch.finfo(_DTYPES[self.dtype]).eps / 2,
            "dtype": self.dtype,
            "informative": self.informative,
        }


_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _gamma(k: int, dtype: torch.dtype) -> float:
    """``γ_k = k·u / (1 − k·u)`` in ``dtype`` (Higham, Lemma 3.1); ``inf`` when ``k·u >= 1``."""
    ku = k * torch.finfo(dtype).eps / 2
    return ku / (1 - ku) if ku < 1 else float("inf")


def rounding_bound(
    model: nn.Module, inputs: Tensor, dtype: torch.dtype = torch.float32
) -> RoundingBound:
    """The largest |difference| two ``dtype`` evaluations of ``model`` (eval mode) on
    ``inputs`` can show when they sum in different orders, from ``dtype``'s unit roundoff and
    the operation count, with how it was derived.

    A layer computes inner products of ``n = fan-in + 1`` terms (the bias included); evaluated
    in floating point in any order, blocked or fused (FMA), one errs by at most ``γ_n`` times
    the sum of its terms' absolute values (Higham, *Accuracy and Stability of Numerical
    Algorithms*, §3.1). A BatchNorm in eval mode adds at most 4 roundings per element
    (``(x − μ) · γ / √(σ² + ε) + β``; folded into the layer before it by a runtime, the same
    4 roundings move into the folded weights), an average pool one per summed term and one
    for the division; ReLU, LeakyReLU, max pooling, flattening, dropout (eval) and identity
    round nothing and are 1-Lipschitz; every leaf module is charged one rounding more, which
    covers a residual addition. The errors of successive layers compose to at most
    ``γ_k · |net|(|x|)`` (``(1 + γ_a)(1 + γ_b) − 1 <= γ_(a+b)``), where ``k`` sums every
    layer's count (no path through the net has more) and ``|net|`` is the network with every
    weight, bias, BatchNorm scale, shift and mean replaced by its absolute value, so that each
    sum of absolute values is what ``|net|`` computes (evaluated in float64, whose own rounding
    is 1e-16 relative). A model zeroed outside a mask, or a submodel extracted from it, has a
    subset of the full model's terms: the full model's ``|net|`` bounds both. Two evaluations,
    each within this of the exact value, differ by at most twice it: that is ``bound``.

    Raises:
        TypeError: ``model`` has a layer without a rounding rule (any but ``Linear``,
            ``Conv2d``, ``BatchNorm2d``, average and max pooling, ``ReLU``, ``LeakyReLU``,
            ``Flatten``, ``Dropout``, ``Identity`` and empty containers).

    >>> net = nn.Linear(3, 1, bias=False)
    >>> _ = net.weight.data.copy_(torch.tensor([[1.0, -2.0, 3.0]]))
    >>> b = rounding_bound(net, torch.tensor([[1.0, 1.0, 1.0]]))
    >>> b.roundings, b.magnitude, b.largest_logit  # 3 + 1 terms, one more for the leaf
    (5, 6.0, 2.0)
    """
    net = copy.deepcopy(model).to(torch.float64).eval()
    roundings = [0]

    def average_pool(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        roundings[0] += args[0].shape[-2] * args[0].shape[-1] + 1  # window <= the whole map

    exact = (
        nn.ReLU,
        nn.LeakyReLU,
        nn.MaxPool2d,
        nn.Flatten,
        nn.Sequential,
        nn.Dropout,
        nn.Identity,
    )
    hooks = []
    with torch.no_grad():
        largest = float(net(inputs.to(torch.float64)).abs().max()) if inputs.numel() else 0.0
        for m in net.modules():
            if list(m.children()):
                continue  # a container: its leaves are counted
            roundings[0] += 1
            if isinstance(m, nn.Linear | nn.Conv2d):
                roundings[0] += m.weight[0].numel() + 1
                m.weight.abs_()
                if m.bias is not None:
                    m.bias.abs_()
            elif isinstance(m, nn.BatchNorm2d):
                roundings[0] += 4
                if m.running_mean is not None:
                    m.running_mean.abs_().neg_()  # |x| - (-|μ|) = |x| + |μ|
                if m.weight is not None:
                    m.weight.abs_()
                    m.bias.abs_()
            elif isinstance(m, nn.AdaptiveAvgPool2d | nn.AvgPool2d):
                hooks.append(m.register_forward_hook(average_pool))
            elif not isinstance(m, exact):
                raise TypeError(f"no rounding rule for {type(m).__name__}")
        try:
            magnitude = float(net(inputs.to(torch.float64).abs()).max()) if inputs.numel() else 0.0
        finally:
            for hook in hooks:
                hook.remove()
    bound = 2 * _gamma(roundings[0], dtype) * magnitude
    return RoundingBound(bound, roundings[0], magnitude, largest, str(dtype).split(".")[-1])


def logit_rounding_bound(
    model: nn.Module, inputs: Tensor, dtype: torch.dtype = torch.float32
) -> float:
    """:attr:`RoundingBound.bound` of :func:`rounding_bound`: how far two float32 (by default)
    evaluations of ``model`` on ``inputs`` may differ without a bug."""
    return rounding_bound(model, inputs, dtype).bound


# ---------------------------------------------------------------------------- what is exported
@dataclass(frozen=True)
class ExportSource:
    """The model state an export writes submodels of, and the round whose masks it uses.

    Attributes:
        round: the round whose masks are exported: 0 for the initial model, else the number of
            rounds the state was trained for (the round a run would go on with).
        state: the algorithm state.
        clock_s: the simulated clock at the start of ``round`` (availability windows).
        checkpoint: the checkpoint folder read, ``None`` for the initial model.
        run_dir: the run folder, when exporting a finished run.
        fallback: why the checkpoint's newest state was refused, when its previous one was
            read instead (:attr:`radbo.checkpoint.Checkpoint.fallback`).
        final_test_accuracy: the run's last test accuracy (``results.json``), when known.
    """

    round: int
    state: Any
    clock_s: float = 0.0
    checkpoint: Path | None = None
    run_dir: Path | None = None
    fallback: str | None = None
    final_test_accuracy: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (the manifest's ``source``)."""
        return {
            "kind": "initial" if self.checkpoint is None else "checkpoint",
            "rounds_trained": self.round,
            "run_dir": None if self.run_dir is None else str(self.run_dir),
            "checkpoint": None if self.checkpoint is None else str(self.checkpoint),
            "fallback": self.fallback,
            "final_test_accuracy": self.final_test_accuracy,
        }


def _checkpoint_folder(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names (the folder, or its ``checkpoint.json``)."""
    folder = Path(path)
    if folder.is_file() and folder.name in ("checkpoint.json", "checkpoint-prev.json"):
        folder = folder.parent
    if not has_checkpoint(folder):
        hint = ""
        if (folder / "results.json").is_file() or (folder / "checkpoints").is_dir():
            hint = (
                f"; {folder} is a run folder: export it with radbo export {folder} (or name "
                f"{folder / 'checkpoints' / 'final'})"
            )
        raise ExportError(f"export error: no checkpoint in {folder} (no checkpoint.json){hint}")
    return folder


def _difference(saved: Any, current: Any, path: str = "") -> str | None:
    """The first setting (dotted path) in which two config dumps differ, as ``"key: saved
    then, current now"``; ``None`` when they agree."""
    if not path and not isinstance(saved, dict):
        return "it records no config"
    if isinstance(saved, dict) and isinstance(current, dict):
        for key in sorted(set(saved) | set(current)):
            if not path and key in CHECKPOINT_IGNORES:
                continue
            where = f"{path}.{key}" if path else str(key)
            if key not in saved or key not in current:
                return f"{where}: {saved.get(key)!r} then, {current.get(key)!r} now"
            found = _difference(saved[key], current[key], where)
            if found is not None:
                return found
        return None
    return None if saved == current else f"{path}: {saved!r} then, {current!r} now"


def load_source(
    experiment: Experiment, checkpoint: str | Path, config: RunConfig | None = None
) -> ExportSource:
    """The state of the checkpoint folder ``checkpoint``, verified and read by
    :func:`radbo.checkpoint.load_checkpoint` into ``experiment``'s state. The config the
    checkpoint was written by must be ``config`` (default ``experiment.config``) but for
    :data:`CHECKPOINT_IGNORES`.

    Raises:
        ExportError: no checkpoint there, or one written by another config (naming the first
            setting that differs).
        CheckpointError: the checkpoint is damaged or does not fit the run.
    """
    folder = _checkpoint_folder(checkpoint)
    expected = (config or experiment.config).model_dump(mode="json")
    index = folder / "checkpoint.json"
    if index.is_file():  # else only the previous index is there: load_checkpoint compares it
        saved = _read_json(index, "checkpoint index")
        found = _difference(saved.get("config") if isinstance(saved, dict) else None, expected)
        if found is not None:
            raise ExportError(
                f"export error: the checkpoint in {folder} was written by another config "
                f"({found}); export it with the config its run used (radbo export RUN_DIR "
                "reads it from the run's results.json)"
            )
    ckpt = load_checkpoint(
        folder,
        template=experiment.initial_state,
        config=expected,
        ignore=CHECKPOINT_IGNORES,
        contents=RUN_CHECKPOINT,
    )
    return ExportSource(
        round=ckpt.rounds_done,
        state=ckpt.state,
        clock_s=ckpt.clock_s,
        checkpoint=folder,
        fallback=ckpt.fallback,
    )


def _read_json(path: Path, what: str) -> Any:
    """Parsed JSON of ``path`` (at most :data:`MAX_JSON_BYTES`); :class:`ExportError`."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_JSON_BYTES + 1)
    except OSError as err:
        raise ExportError(f"export error: cannot read {path}: {err.strerror or err}") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ExportError(
            f"export error: {path} is larger than {MAX_JSON_BYTES} bytes, more than any "
            f"{what} radbo writes"
        )
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        detail = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise ExportError(f"export error: {path} is not a valid {what}: {detail}") from None


def read_run_config(run_dir: str | Path) -> tuple[RunConfig, dict[str, Any]]:
    """The config a finished run folder's ``results.json`` records (validated as a config file
    is) and the parsed ``results.json``.

    Raises:
        ExportError: no ``results.json`` (not a finished run), not JSON, no config in it, or a
            config radbo refuses (the reason, naming the file).
    """
    folder = Path(run_dir)
    path = folder / "results.json"
    if not path.is_file():
        seeds = sorted(p.parent.name for p in folder.glob("*/results.json"))
        hint = (
            f"; it holds the runs {', '.join(seeds[:3])}{', ...' if len(seeds) > 3 else ''}: "
            f"export one of them (radbo export {folder / seeds[0]})"
            if seeds
            else " (radbo export CONFIG.toml --checkpoint PATH exports a checkpoint of a run "
            "that has not finished)"
        )
        raise ExportError(
            f"export error: {folder} has no results.json: not a finished radbo run folder{hint}"
        )
    results = _read_json(path, "results.json")
    if not isinstance(results, dict) or not isinstance(results.get("config"), dict):
        raise ExportError(f"export error: {path} records no config (no 'config' table)")
    try:
        config = parse_config(results["config"])
    except ConfigError as err:
        raise ExportError(f"export error: the config in {path} is refused: {err}") from None
    return config, results


def find_final_checkpoint(run_dir: str | Path, config: RunConfig) -> Path:
    """The checkpoint folder of ``run_dir`` after its last round: ``checkpoints/final``
    (what ``radbo run`` writes) or, for a run with ``checkpoint_every``, ``checkpoints/run``;
    the first whose index records ``rounds_done == config.rounds`` and ``config`` (so that a
    checkpoint a former run left in the folder is passed over).

    Raises:
        ExportError: neither holds the state after the last round (one line saying what is
            there and how to export it).
    """
    folder = Path(run_dir)
    rounds = config.rounds
    expected = config.model_dump(mode="json")
    seen = []
    for candidate in (folder / "checkpoints" / "final", folder / "checkpoints" / "run"):
        if not has_checkpoint(candidate):
            continue
        index_path = candidate / "checkpoint.json"
        if not index_path.is_file():
            seen.append(
                f"{index_path} is not a regular file"
                if os.path.lexists(index_path)
                else f"{candidate} has no checkpoint.json"
            )
            continue
        index = _read_json(index_path, "checkpoint index")
        done = index.get("rounds_done") if isinstance(index, dict) else None
        other = _difference(index.get("config") if isinstance(index, dict) else None, expected)
        if done == rounds and other is None:
            return candidate
        seen.append(
            f"{candidate} is after round {done}"
            if other is None
            else f"{candidate} is of another run ({other})"
        )
    what = "; ".join(seen) if seen else "it has no checkpoints/final or checkpoints/run"
    raise ExportError(
        f"export error: {folder} holds no state after its last round {rounds} ({what}); a run "
        "made before radbo wrote checkpoints/final must be run again, or export a checkpoint "
        "with --checkpoint PATH"
    )


def _export_config(config: RunConfig) -> RunConfig:
    """``config`` built on the CPU with the sequential backend: an export trains nothing and
    writes CPU programs, whatever device or backend the run used."""
    runtime = config.runtime.model_copy(update={"device": "cpu", "backend": "sequential"})
    return config.model_copy(update={"runtime": runtime})


# ---------------------------------------------------------------------------- masks
def round_assignment(
    experiment: Experiment, state: Any, round: int
) -> tuple[StructurePlan, list[IndexSet], list[ClientBudget]]:
    """Structure plan, index set and budget of every client of ``experiment`` in ``round``
    from ``state``, as ``Simulation.step`` assigns them, with ``prepare`` called on all clients
    (see the module docstring for when that can differ from the run's round)."""
    sim = experiment.simulation
    clients = list(range(len(sim.clients)))
    budgets = sim.round_budgets(round, clients)
    if sim.masks is None:  # the client side's plan when it has one (a fleet's memory model)
        plan = experiment.client_side.model.plan
        if plan is None:
            plan = structure_plan(experiment.model)
        return plan, [plan.full_index_set() for _ in clients], budgets
    assert isinstance(sim.masks, SubmodelAssigner), "build() gives a SubmodelAssigner"
    index_sets = sim.round_index_sets(state, round, clients, budgets)
    return sim.masks.plan, index_sets, budgets


def round0_assignment(
    experiment: Experiment,
) -> tuple[StructurePlan, list[IndexSet], list[ClientBudget]]:
    """:func:`round_assignment` of the initial state in round 0."""
    return round_assignment(experiment, experiment.initial_state, 0)


def _key(index_set: IndexSet) -> tuple:
    return tuple(
        (name, tuple(None if e is None else tuple(e.tolist()) for e in entry))
        for name, entry in sorted(index_set.items())
    )


def _masked_state(plan: StructurePlan, state: Params, index_set: IndexSet) -> Params:
    """``state`` with every tensor zeroed outside ``index_set``."""
    masks = dense_mask(index_set, plan.shapes)
    return {k: torch.where(masks[k], v, torch.zeros_like(v)) for k, v in state.items()}


def _masked_full_model(plan: StructurePlan, state: Params, index_set: IndexSet) -> nn.Module:
    """The full model with every tensor zeroed outside ``index_set``, in eval mode."""
    model = copy.deepcopy(plan.model)
    model.load_state_dict(_masked_state(plan, state, index_set))
    return model.eval()


def _masked_full_logits(
    plan: StructurePlan, state: Params, index_set: IndexSet, inputs: Tensor
) -> Tensor:
    """Logits of the full model with every tensor zeroed outside ``index_set``, restricted to
    the kept outputs (eval mode)."""
    model = _masked_full_model(plan, state, index_set)
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


def _check_options(
    formats: str | Sequence[str],
    quantize: str | None,
    latency_runs: int,
    tolerance: float | None,
    accuracy_examples: int,
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
    if tolerance is not None and not (
        isinstance(tolerance, int | float) and not isinstance(tolerance, bool) and tolerance >= 0
    ):
        raise ExportError(
            f"export error: tolerance = {tolerance!r}: must be a number >= 0, or None for the "
            "bound derived from float32's rounding"
        )
    if (
        isinstance(accuracy_examples, bool)
        or not isinstance(accuracy_examples, int)
        or accuracy_examples < 0
    ):
        raise ExportError(
            f"export error: accuracy_examples = {accuracy_examples!r}: must be an integer >= 0 "
            "(0: no accuracy measurement)"
        )
    for fmt in edge:
        require(fmt)
    return chosen, edge


@dataclass
class _Submodel:
    """One distinct submodel: its index set and the clients that train it."""

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


def _model_state(experiment: Experiment, state: Any) -> Params:
    sim = experiment.simulation
    return {k: v.detach().cpu().clone() for k, v in sim.algorithm.model_state(state).items()}


def _state(experiment: Experiment) -> Params:
    return _model_state(experiment, experiment.initial_state)


def _submodel_state(
    experiment: Experiment, plan: StructurePlan, state: Params, index_set: IndexSet
) -> Params:
    """The full-model state a submodel is extracted from: ``state``, with static BatchNorm's
    running statistics recomputed for the submodel (over the server's calibration set, as the
    run's evaluation recomputes them for the global model). Zeroing outside the mask and
    recomputing gives the kept channels exactly the statistics the submodel computes itself."""
    from radbo.experiment.evaluation import calibration_inputs
    from radbo.problem import calibrate_batchnorm, split_state

    config = experiment.config
    if not config.model.static_batchnorm:
        return state
    calibration = calibration_inputs(config, experiment.train)
    assert calibration is not None, "static BN has a calibration set"
    model = experiment.model
    dtype = next(iter(model.parameters())).dtype
    masked = _masked_state(plan, state, index_set)
    x, y, b = split_state(masked, set(model.outer_param_names()), set(model.inner_param_names()))
    module = copy.deepcopy(plan.model)
    with torch.no_grad():
        fresh = calibrate_batchnorm(module, x, y, b, calibration.to(dtype))
    return {**state, **fresh}


def _classes_match(labels: Tensor, outputs: int) -> bool:
    """Whether the test labels are the model's output classes (not in few-shot meta-testing,
    whose test set holds other classes than the ones trained on)."""
    return bool(labels.numel()) and int(labels.max()) < outputs


def _predict(module: nn.Module, features: Tensor) -> Tensor:
    with torch.no_grad():
        return torch.cat([module(part) for part in features.split(_EVAL_BATCH)])


def _top1(logits: Tensor, labels: Tensor) -> float:
    return float((logits.argmax(1) == labels).double().mean())


# ---------------------------------------------------------------------------- the export
def export_run(
    run_dir: str | Path,
    out_dir: str | Path,
    *,
    checkpoint: str | Path | None = None,
    formats: str | Sequence[str] = ("safetensors",),
    torch_export: bool = False,
    quantize: str | None = None,
    latency_runs: int = LATENCY_RUNS,
    tolerance: float | None = None,
    accuracy_examples: int = ACCURACY_EXAMPLES,
) -> ExportResult:
    """Write every client's submodel of the model a finished run trained (``radbo export
    RUN_DIR``).

    The config is the one ``run_dir/results.json`` records; the state is the run's final one
    (:func:`find_final_checkpoint`), or that of ``checkpoint`` when given (any checkpoint
    folder the run wrote). The other arguments are :func:`export_submodels`'.

    Raises:
        ExportError: ``run_dir`` is not a finished run folder, holds no final state, or an
            option is invalid (see :func:`export_submodels`).
        CheckpointError: the checkpoint is damaged or of another config.
        ExportCheckError: see :func:`export_submodels`.
    """
    folder = Path(run_dir)
    config, results = read_run_config(folder)
    final_state = checkpoint is None
    if checkpoint is None:
        checkpoint = find_final_checkpoint(folder, config)
    final = results.get("final")
    accuracy = final.get("test_accuracy") if isinstance(final, dict) else None
    return _export(
        config,
        out_dir,
        checkpoint=checkpoint,
        run_dir=folder,
        final_test_accuracy=accuracy if isinstance(accuracy, int | float) else None,
        options=_Options(
            formats, torch_export, quantize, latency_runs, tolerance, accuracy_examples
        ),
        require_round=config.rounds if final_state else None,
    )


def export_submodels(
    config: RunConfig,
    out_dir: str | Path,
    *,
    checkpoint: str | Path | None = None,
    formats: str | Sequence[str] = ("safetensors",),
    torch_export: bool = False,
    quantize: str | None = None,
    latency_runs: int = LATENCY_RUNS,
    tolerance: float | None = None,
    accuracy_examples: int = ACCURACY_EXAMPLES,
) -> ExportResult:
    """Write every client's submodel of ``config``'s run to ``out_dir`` and check it.

    See the module docstring for the files, the check, the accuracy and which round's masks.

    Args:
        config: the run configuration (as for :func:`radbo.run`).
        out_dir: the output folder (created if needed).
        checkpoint: a checkpoint folder the run of ``config`` wrote (or its
            ``checkpoint.json``): export its trained state with the masks of the round after
            it. Default: the initial model, round 0.
        formats: which files to write per distinct submodel: ``"safetensors"`` (default),
            ``"pte"``, ``"onnx"``, as a sequence or a comma-separated string.
        torch_export: also write a ``torch.export`` program per distinct submodel.
        quantize: ``"int8"`` to write an int8 ``.pte`` next to the FP32 one (needs ``pte``).
        latency_runs: timed runs per latency figure of an edge program (default 20; 0: none).
        tolerance: the largest |submodel logits - masked full model logits| allowed. Default
            (``None``): :func:`logit_rounding_bound` of each submodel's masked full model on
            the check batch; a model with a layer it has no rule for is then not held to a
            tolerance (the manifest says so).
        accuracy_examples: test examples (the first of the test set) each submodel's accuracy
            is measured on, in PyTorch and per runtime (0: none).

    Returns:
        An :class:`ExportResult` whose ``manifest`` is what ``manifest.json`` holds.

    Raises:
        ConfigError, DeviceTooSmallError: the config cannot be built.
        CheckpointError: the checkpoint is damaged, of another config, or does not fit.
        ExportError: an option is invalid, a package an edge format needs is missing, there is
            no checkpoint at ``checkpoint``, or the output folder cannot be created or written.
        ExportCheckError: a written file does not reproduce the masked full model within
            the tolerance (raised after the manifest is written).
    """
    return _export(
        config,
        out_dir,
        checkpoint=checkpoint,
        options=_Options(
            formats, torch_export, quantize, latency_runs, tolerance, accuracy_examples
        ),
    )


@dataclass(frozen=True)
class _Options:
    formats: str | Sequence[str]
    torch_export: bool
    quantize: str | None
    latency_runs: int
    tolerance: float | None
    accuracy_examples: int


def _export(
    config: RunConfig,
    out_dir: str | Path,
    *,
    checkpoint: str | Path | None,
    options: _Options,
    run_dir: Path | None = None,
    final_test_accuracy: float | None = None,
    require_round: int | None = None,
) -> ExportResult:
    """Export and check every distinct submodel of ``config``'s run (see the module
    docstring): build the run, find the state and its round's masks, write and check each
    submodel, then the manifest."""
    chosen, edge = _check_options(
        options.formats,
        options.quantize,
        options.latency_runs,
        options.tolerance,
        options.accuracy_examples,
    )
    out = Path(out_dir)
    exp = build(_export_config(config))
    source = replace(
        _source(exp, config, checkpoint, require_round),
        run_dir=run_dir,
        final_test_accuracy=final_test_accuracy,
    )
    _prepare_folder(out)
    exported = _exported_round(exp, source)
    writer = _writer(exp, out, chosen, edge, options)
    groups = _distinct(exported.index_sets)
    try:
        written = [_submodel_entry(writer, exp, exported, group) for group in groups.values()]
    except OSError as err:
        where = err.filename or out
        raise ExportError(f"export error: cannot write {where}: {err.strerror or err}") from None
    per_submodel = {g.first: w.entry for g, w in zip(groups.values(), written, strict=True)}
    manifest = _manifest(exp, source, exported, writer, groups, written)
    return _write_manifest(manifest, writer, per_submodel)


def _source(
    exp: Experiment, config: RunConfig, checkpoint: str | Path | None, require_round: int | None
) -> ExportSource:
    """The state to export: the initial one (round 0), or that of ``checkpoint``, which must
    be after round ``require_round`` when that is given (a run's final checkpoint)."""
    if checkpoint is None:
        return ExportSource(round=0, state=exp.initial_state)
    source = load_source(exp, checkpoint, config)
    if require_round is not None and source.round != require_round:
        raise ExportError(
            f"export error: the final checkpoint in {source.checkpoint} is damaged "
            f"({source.fallback}); its previous one is after round {source.round}, not the "
            f"run's last: export it with --checkpoint {source.checkpoint} if that is meant"
        )
    return source


@dataclass
class _ExportedRound:
    """The round whose masks are exported: its number, the state's model tensors (CPU), every
    client's structure plan, index set and budget, which clients take part and the index sets
    the round itself gives them."""

    number: int
    state: Params
    plan: StructurePlan
    index_sets: list[IndexSet]
    budgets: list[ClientBudget]
    sampled: list[int]
    round_sets: dict[int, IndexSet]

    @property
    def clients(self) -> list[int]:
        """Every client of the fleet."""
        return list(range(len(self.index_sets)))


def _exported_round(exp: Experiment, source: ExportSource) -> _ExportedRound:
    """Every client's mask in ``source``'s round (``prepare`` called on all clients), and the
    masks the round itself gives the clients it samples (these differ only for a policy that
    prepares on the round's clients together, e.g. ``coverage``)."""
    sim, round_ = exp.simulation, source.round
    state = _model_state(exp, source.state)
    plan, index_sets, budgets = round_assignment(exp, source.state, round_)
    clients = list(range(len(index_sets)))
    sampled = sim.sample_clients(round_, clock_s=source.clock_s)
    round_sets = dict(zip(clients, index_sets, strict=True))
    masks = sim.masks
    if isinstance(masks, SubmodelAssigner) and isinstance(masks.policy, RoundPreparedPolicy):
        if sampled != clients:
            actual = sim.round_index_sets(
                source.state, round_, sampled, sim.round_budgets(round_, sampled)
            )
            round_sets = dict(zip(sampled, actual, strict=True))
    return _ExportedRound(round_, state, plan, index_sets, budgets, sampled, round_sets)


@dataclass
class _Writer:
    """What writing and checking every distinct submodel of one export shares: the output
    folder, the chosen formats and options, the edge set-up, the check batch, the training
    batch size and the files written so far."""

    out: Path
    chosen: tuple[str, ...]
    options: _Options
    setup: _EdgeSetup
    inputs: Tensor
    batch_size: int
    test_count: int
    examples: int
    files: list[Path] = field(default_factory=list)


def _writer(
    exp: Experiment, out: Path, chosen: tuple[str, ...], edge: tuple[str, ...], options: _Options
) -> _Writer:
    """The :class:`_Writer` of an export of ``exp`` to ``out``."""
    config, model = exp.config, exp.model
    dtype = next(iter(model.parameters())).dtype
    inputs = exp.test.features[:CHECK_BATCH].to(dtype)
    batch_size = int(config.algorithm.batch_size)
    test_count = int(exp.test.features.shape[0])
    examples = min(options.accuracy_examples, test_count)
    setup = _EdgeSetup(
        edge=edge,
        quantize=options.quantize,
        runs=options.latency_runs,
        batches=sorted({1, batch_size}),
        max_batch=max(batch_size, int(inputs.shape[0]), 1),
        calibration=calibration_set(exp.train, CALIBRATION_EXAMPLES, config.seed).to(torch.float32),
        test_features=exp.test.features[:examples],
        test_labels=exp.test.labels[:examples],
    )
    return _Writer(out, chosen, options, setup, inputs, batch_size, test_count, examples)


@dataclass
class _Written:
    """One distinct submodel written and checked: its manifest entry, the derivation of its
    tolerance, and whether the accuracy sample's labels are its classes."""

    entry: dict[str, Any]
    derivation: dict[str, Any]
    classes: bool


def _safetensors(
    writer: _Writer, state: Params, group: _Submodel, round_: int
) -> tuple[str | None, Params, Params]:
    """Write ``client-<first>.safetensors`` when chosen; (its name or ``None``, the tensors,
    the tensors read back from the file, or from the bytes when no file is written)."""
    idx = group.index_set
    tensors = {k: v.contiguous() for k, v in extract(state, idx).items()}
    data = safetensors_bytes(
        tensors,
        metadata={
            "format": "pt",
            "producer": FORMAT,
            "clients": str(group.clients),
            "round": str(round_),
        },
    )
    name: str | None = None
    if "safetensors" in writer.chosen:
        name = f"client-{group.first}.safetensors"
        _write_bytes(writer.out / name, data)
        writer.files.append(writer.out / name)
    loaded = load_file(writer.out / name) if name else safetensors_load(data)
    return name, tensors, loaded


def _submodel_entry(
    writer: _Writer, exp: Experiment, exported: _ExportedRound, group: _Submodel
) -> _Written:
    """Write one distinct submodel and check it: read back, compare bitwise, load into a
    fresh submodel and compare its logits with the masked full model's; then its edge files."""
    plan, first, idx = exported.plan, group.first, group.index_set
    state = _submodel_state(exp, plan, exported.state, idx)
    name, tensors, loaded = _safetensors(writer, state, group, exported.number)
    same_tensors = set(loaded) == set(tensors) and all(
        loaded[k].dtype == tensors[k].dtype and torch.equal(loaded[k], tensors[k]) for k in tensors
    )
    sub = plan.submodel(idx)
    sub.load_state_dict(loaded, strict=True)
    sub.eval()
    with torch.no_grad():
        logits = sub(writer.inputs)
    want = _masked_full_logits(plan, state, idx, writer.inputs)
    diff = _diff(logits, want) if same_tensors else float("inf")
    bound, derivation = _tolerance(plan, state, idx, writer.inputs, writer.options.tolerance)
    outer, inner = set(exp.model.outer_param_names()), set(exp.model.inner_param_names())
    entry: dict[str, Any] = {
        "file": name,
        "parameters": sum(p.numel() for p in sub.parameters()),
        "parameters_x": sum(p.numel() for n, p in sub.named_parameters() if n in outer),
        "parameters_y": sum(p.numel() for n, p in sub.named_parameters() if n in inner),
        "bytes": tensor_bytes(loaded),
        "index_metadata_bytes": index_metadata_bytes(idx),
        "flops_per_step": training_step_flops(sub, writer.batch_size),
        "shapes": {k: list(v.shape) for k, v in loaded.items()},
        "kept": {
            k: [None if e is None else [int(i) for i in e.tolist()] for e in dims]
            for k, dims in idx.items()
        },
        "max_abs_diff": diff,
        "tolerance": bound,
        "torch_export": None,
    }
    if writer.options.torch_export:
        entry["torch_export"] = _export_program(
            sub, writer.inputs, logits, writer.out, first, writer.files
        )
    reference = _Reference.of(sub, writer.setup)
    _edge_records(writer, entry, sub, want.to(torch.float32), first, reference)
    return _Written(entry, derivation, reference.classes_match)


def _edge_records(
    writer: _Writer,
    entry: dict[str, Any],
    sub: nn.Module,
    want32: Tensor,
    first: int,
    reference: _Reference,
) -> None:
    """Add to ``entry`` the record of every edge format (``None``: not chosen), the int8
    program's and the accuracy summary; list the edge files written."""
    setup, out, inputs = writer.setup, writer.out, writer.inputs
    for fmt in EDGE_FORMATS:
        entry[fmt] = None
        if fmt in setup.edge:
            entry[fmt] = _edge_file(sub, fmt, None, inputs, want32, out, first, setup, reference)
    for q in QUANTIZATIONS:
        entry[f"pte_{q}"] = None
    quantize = setup.quantize
    if quantize is not None:
        entry[f"pte_{quantize}"] = _edge_file(
            sub, "pte", quantize, inputs, want32, out, first, setup, reference
        )
    entry["accuracy"] = _accuracy_summary(entry, reference)
    writer.files.extend(out / e["file"] for e in _edge_entries(entry) if e.get("file"))


def _client_entries(
    exp: Experiment,
    exported: _ExportedRound,
    groups: dict[tuple, _Submodel],
    per_submodel: dict[int, dict[str, Any]],
) -> list[dict[str, Any]]:
    """One manifest entry per client: device, budget, whether it takes part in the round and
    gets the exported mask there, the clients it shares its submodel with, and the
    submodel's entry."""
    submodel_of = {c: g.first for g in groups.values() for c in g.clients}
    index_sets, sampled, round_sets = exported.index_sets, exported.sampled, exported.round_sets
    entries = []
    for c, budget in zip(exported.clients, exported.budgets, strict=True):
        first = submodel_of[c]
        shared = groups[_key(index_sets[first])].clients
        device = tier = None
        if exp.fleet is not None:
            profile = exp.fleet[c]
            device, tier = profile.name, profile.tier or profile.name
        in_round = c in round_sets and c in sampled
        entries.append(
            {
                "client": c,
                "device": device,
                "tier": tier,
                "capacity": budget.capacity,
                "local_steps": budget.local_steps,
                "in_round": {
                    "takes_part": c in sampled,
                    "mask_equal": (
                        _key(round_sets[c]) == _key(index_sets[c]) if in_round else None
                    ),
                },
                "shared_with": [m for m in shared if m != c],
                **per_submodel[first],
            }
        )
    return entries


def _worst(per_submodel: dict[int, dict[str, Any]]) -> float:
    """The largest difference any written file shows against the masked full model."""
    worst = max((e["max_abs_diff"] for e in per_submodel.values()), default=0.0)
    for e in per_submodel.values():
        for checked in (e["torch_export"], e["pte"], e["onnx"]):
            if checked is not None and "max_abs_diff" in checked:
                worst = max(worst, checked["max_abs_diff"])
    return float(worst)


def _failed(
    exported: _ExportedRound,
    groups: dict[tuple, _Submodel],
    per_submodel: dict[int, dict[str, Any]],
) -> list[int]:
    """The clients whose submodel's check failed."""
    submodel_of = {c: g.first for g in groups.values() for c in g.clients}
    return sorted(c for c in exported.clients if not _passes(per_submodel[submodel_of[c]]))


def _manifest(
    exp: Experiment,
    source: ExportSource,
    exported: _ExportedRound,
    writer: _Writer,
    groups: dict[tuple, _Submodel],
    written: list[_Written],
) -> dict[str, Any]:
    """``manifest.json``'s content; ``written``: the distinct submodels in ``groups``' order."""
    from radbo.version import __version__

    config, setup = exp.config, writer.setup
    per_submodel = {g.first: w.entry for g, w in zip(groups.values(), written, strict=True)}
    # whether the accuracy sample's labels are the model's classes (the last submodel tells)
    classes = written[-1].classes if written else False
    failed = _failed(exported, groups, per_submodel)
    unsupported = [
        {"client": first, "format": fmt, "error": e[fmt]["error"]}
        for first, e in per_submodel.items()
        for fmt in (*EDGE_FORMATS, *(f"pte_{q}" for q in QUANTIZATIONS))
        if isinstance(e.get(fmt), dict) and "error" in e[fmt]
    ]
    bounds = [e["tolerance"] for e in per_submodel.values() if e["tolerance"] is not None]
    return {
        "format": FORMAT,
        "radbo_version": __version__,
        "torch_version": torch.__version__,
        "source": source.as_dict(),
        "round": exported.number,
        "mask_policy": config.mask.policy,
        "batch_size": writer.batch_size,
        "formats": list(writer.chosen),
        "model": _model_record(exp, exported, writer.batch_size),
        "edge": _edge_summary(setup, config.seed) if setup.edge else None,
        "accuracy": _accuracy_record(writer, classes),
        "check": {
            "batch": list(writer.inputs.shape),
            "tolerance": None if not bounds else max(bounds),
            "tolerance_rule": "given" if writer.options.tolerance is not None else "derived",
            "derivation": [w.derivation for w in written],
            "max_abs_diff": _worst(per_submodel),
            "passed": not failed,
            "failed_clients": failed,
            "unsupported": unsupported,
        },
        "submodels": len(groups),
        "clients": _client_entries(exp, exported, groups, per_submodel),
        "config": config.model_dump(mode="json"),
    }


def _model_record(exp: Experiment, exported: _ExportedRound, batch_size: int) -> dict[str, Any]:
    """The manifest's record of the full model."""
    config, model, plan = exp.config, exp.model, exported.plan
    full_sub = plan.submodel(plan.full_index_set())
    return {
        "name": config.model.name,
        "class": type(model).__name__,
        "input_shape": list(getattr(model, "input_shape", ())),
        "output_layers": list(plan.output_layers),
        "outer": model.outer_param_names(),
        "inner": model.inner_param_names(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes": tensor_bytes(exported.state),
        "flops_per_step": training_step_flops(full_sub, batch_size),
        "static_batchnorm": bool(config.model.static_batchnorm),
    }


def _accuracy_record(writer: _Writer, classes: bool) -> dict[str, Any]:
    """The manifest's record of the accuracy sample (``classes``: its labels are the model's
    classes)."""
    examples, test_count = writer.examples, writer.test_count
    measured = classes and examples > 0
    if measured:
        why_not = None
    elif examples == 0:
        why_not = "accuracy_examples = 0"
    else:
        why_not = (
            "the test set holds other classes than the model's outputs (few-shot "
            "meta-testing fits a head per episode)"
        )
    return {
        "examples": examples if classes else 0,
        "test_examples": test_count,
        "sample": f"the first {examples} of the run's {test_count} test examples",
        "measured": measured,
        "why_not": why_not,
    }


def _write_manifest(
    manifest: dict[str, Any], writer: _Writer, per_submodel: dict[int, dict[str, Any]]
) -> ExportResult:
    """Write ``manifest.json`` (last); the result, or :class:`ExportCheckError` carrying it
    when a check failed."""
    manifest_path = writer.out / "manifest.json"
    try:
        atomic_write_text(manifest_path, json_dumps(manifest, indent=2) + "\n")
    except OSError as err:
        raise ExportError(
            f"export error: cannot write {manifest_path}: {err.strerror or err}"
        ) from None
    writer.files.append(manifest_path)
    check = manifest["check"]
    failed, worst = check["failed_clients"], check["max_abs_diff"]
    result = ExportResult(
        out_dir=writer.out,
        manifest_path=manifest_path,
        manifest=manifest,
        files=writer.files,
        max_abs_diff=worst,
        passed=not failed,
    )
    if failed:
        bounds = [e["tolerance"] for e in per_submodel.values() if e["tolerance"] is not None]
        shown = ", ".join(f"{b:.3g}" for b in sorted(set(bounds))) or "none"
        raise ExportCheckError(
            f"export check failed: the submodels of clients {failed} differ from the masked "
            f"full model by up to {worst:.3g} (tolerance {shown}); see {manifest_path}",
            result,
        )
    return result


def _tolerance(
    plan: StructurePlan,
    state: Params,
    index_set: IndexSet,
    inputs: Tensor,
    given: float | None,
) -> tuple[float | None, dict[str, Any]]:
    """The check's tolerance for one submodel: ``given``, or :func:`rounding_bound` of its
    masked full model on the check batch (``None`` when the model has a layer without a
    rounding rule), with its derivation for the manifest."""
    if given is not None:
        return float(given), {"rule": "given", "bound": float(given)}
    try:
        derived = rounding_bound(_masked_full_model(plan, state, index_set), inputs)
    except TypeError as err:
        return None, {"rule": "none", "bound": None, "why": str(err)}
    return derived.bound, {"rule": "derived", **derived.as_dict()}


def _edge_entries(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The edge-format records of a manifest entry (``pte``, ``onnx``, ``pte_int8``)."""
    keys = (*EDGE_FORMATS, *(f"pte_{q}" for q in QUANTIZATIONS))
    return [entry[k] for k in keys if isinstance(entry.get(k), dict)]


def _within(diff: float, tolerance: float | None) -> bool:
    """A difference passes its tolerance (any finite one when there is no tolerance)."""
    return diff <= tolerance if tolerance is not None else diff < float("inf")


def _passes(entry: dict[str, Any]) -> bool:
    """The submodel's own check, its ``.pt2`` and its FP32 edge programs within its
    ``tolerance`` (an edge format a runtime cannot take is recorded, not a failure)."""
    tolerance = entry["tolerance"]
    if not _within(entry["max_abs_diff"], tolerance):
        return False
    records = (entry["torch_export"], *(entry[fmt] for fmt in EDGE_FORMATS))
    return all(
        _within(r["max_abs_diff"], tolerance)
        for r in records
        if r is not None and "max_abs_diff" in r
    )


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


@dataclass
class _Reference:
    """A submodel's PyTorch logits on the accuracy sample (``None`` without a sample) and
    whether the sample's labels are its classes."""

    logits: Tensor | None
    labels: Tensor
    classes_match: bool

    @classmethod
    def of(cls, sub: nn.Module, setup: _EdgeSetup) -> _Reference:
        features = setup.test_features
        if not features.shape[0]:
            return cls(None, setup.test_labels, False)
        dtype = next(iter(sub.parameters())).dtype
        logits = _predict(sub, features.to(dtype))
        return cls(logits, setup.test_labels, _classes_match(setup.test_labels, logits.shape[1]))

    def accuracy(self, logits: Tensor | None = None) -> float | None:
        """Top-1 accuracy of ``logits`` (default: the PyTorch submodel's) on the sample."""
        chosen = self.logits if logits is None else logits
        if chosen is None or not self.classes_match:
            return None
        return _top1(chosen, self.labels)


def _accuracy_summary(entry: dict[str, Any], reference: _Reference) -> dict[str, Any]:
    """Per submodel: test accuracy in PyTorch and per runtime, the int8 drop (PyTorch FP32
    minus int8 ExecuTorch) and the largest gap of an FP32 runtime to PyTorch."""
    pytorch = reference.accuracy()
    runtimes: dict[str, float | None] = {}
    for key in (*EDGE_FORMATS, *(f"pte_{q}" for q in QUANTIZATIONS)):
        record = entry.get(key)
        runtimes[key] = record.get("test_accuracy") if isinstance(record, dict) else None
    fp32 = [a for f in EDGE_FORMATS if (a := runtimes[f]) is not None]
    int8 = runtimes.get("pte_int8")
    return {
        "pytorch": pytorch,
        **runtimes,
        "int8_drop": None if pytorch is None or int8 is None else pytorch - int8,
        "largest_fp32_runtime_gap": (
            None if pytorch is None or not fp32 else max(abs(a - pytorch) for a in fp32)
        ),
    }


def _edge_summary(setup: _EdgeSetup, seed: int) -> dict[str, Any]:
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
        "max_batch_rule": (
            f"a .pte takes batches of 1 to its max_batch ({setup.max_batch} here; ExecuTorch "
            "plans its memory for that bound): radbo.edge refuses a larger batch with an error "
            "naming max_batch, and EdgeProgram.run_batches splits one into chunks"
        ),
        "calibration_examples": int(setup.calibration.shape[0]) if setup.quantize else 0,
        "calibration": (
            f"a seeded sample (run seed {seed}) of the run's training set: the server's "
            "calibration set (radbo.data.calibration_set)"
            if setup.quantize
            else None
        ),
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
    reference: _Reference | None = None,
) -> dict[str, Any]:
    """Lower ``sub`` to ``fmt``, write it, load the file back in its runtime, check it against
    the masked full model's logits ``want`` and measure its accuracy on the sample; the record
    for the manifest."""
    name = f"client-{first}.{quantize + '.' if quantize else ''}{fmt}"
    inputs = inputs.to(torch.float32)
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
        program.dynamic_batch = lowered.dynamic_batch
        got = program(inputs)
        sample = (
            program.run_batches(setup.test_features.to(torch.float32))
            if setup.test_features.shape[0]
            else None
        )
    except ExportError as err:  # the runtime refuses what its exporter wrote: recorded
        return {**record, "error": str(err)}
    if reference is None:
        reference = _Reference.of(sub, setup)
    record["test_accuracy"] = None if sample is None else reference.accuracy(sample)
    if quantize is None:
        record["max_abs_diff"] = _diff(got, want)
    else:  # not held to the FP32 tolerance: reported against the FP32 submodel instead
        record["quantize"] = quantize
        record.update(_int8_record(sample, reference))
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


def _int8_record(int8: Tensor | None, reference: _Reference) -> dict[str, Any]:
    """The int8 program against the FP32 submodel (PyTorch) on the accuracy sample: largest
    difference, top-1 agreement and (when the test labels are the model's classes) both
    accuracies and the drop."""
    fp32 = reference.logits
    record: dict[str, Any] = {
        "examples": 0 if fp32 is None else int(fp32.shape[0]),
        "max_abs_diff_vs_fp32": None,
        "top1_agreement": None,
        "test_accuracy_fp32": None,
        "test_accuracy_int8": None,
        "accuracy_drop": None,
    }
    if fp32 is None or int8 is None:
        return record
    record["max_abs_diff_vs_fp32"] = _diff(int8, fp32)
    record["top1_agreement"] = float((int8.argmax(1) == fp32.argmax(1)).double().mean())
    acc32, acc8 = reference.accuracy(), reference.accuracy(int8)
    if acc32 is not None and acc8 is not None:
        record.update(test_accuracy_fp32=acc32, test_accuracy_int8=acc8, accuracy_drop=acc32 - acc8)
    return record


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


# ---------------------------------------------------------------------------- the table
def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _micro(record: dict[str, Any] | None) -> str:
    latency = (record or {}).get("latency") or []
    return f"{latency[-1]['per_sample_s'] * 1e6:.1f}" if latency else "-"


def _wrapped(text: str, width: int, indent: str) -> list[str]:
    import textwrap

    lines = textwrap.wrap(
        text,
        width=width,
        subsequent_indent=indent,
        break_on_hyphens=False,  # paths and names stay whole
        break_long_words=False,
    )
    return lines or [text]


def export_table(manifest: dict[str, Any], width: int = 100) -> str:
    """An export manifest as text of at most ``width`` columns (what ``radbo export`` prints):
    what was exported, one row per client (device as a numbered reference to the device list
    below it, so that no name is cut), one row per distinct submodel (size, the check), and
    one per submodel with its test accuracy and latency per runtime."""
    clients = manifest["clients"]
    firsts = sorted({_first(c) for c in clients})
    entry = {c["client"]: c for c in clients}
    return "\n".join(
        [
            *_client_rows(manifest, width),
            "",
            *_submodel_rows(entry, firsts),
            *_accuracy_rows(manifest, entry, firsts, width),
        ]
    )


def _client_rows(manifest: dict[str, Any], width: int) -> list[str]:
    """The table's head (what was exported), one row per client, and the device list."""
    clients = manifest["clients"]
    source = manifest.get("source") or {}
    if source.get("kind") == "checkpoint":
        what = f"the model trained for {source['rounds_trained']} rounds ({source['checkpoint']})"
    else:
        what = "the initial model"
    lines = _wrapped(
        f"submodels of {what}, with the masks of round {manifest['round']} "
        f"({manifest['mask_policy']})",
        width,
        "  ",
    )
    devices: list[str] = []
    for c in clients:
        if c["device"] and c["device"] not in devices:
            devices.append(c["device"])
    ref = {name: f"[{i + 1}]" for i, name in enumerate(devices)}
    lines.append(
        f"{'client':>6}  {'device':<6}  {'tier':<12}  {'r':>6}  {'tau':>5}  {'in round':<8}  "
        "submodel"
    )
    for c in clients:
        tier = str(c["tier"] or "-")
        part = "yes" if c["in_round"]["takes_part"] else "no"
        lines.append(
            f"{c['client']:>6}  {ref.get(c['device'], '-'):<6}  {tier:<12}  "
            f"{c['capacity']:>6.4g}  {c['local_steps']:>5}  {part:<8}  client-{_first(c)}"
        )
    for name in devices:
        lines.extend(_wrapped(f"{ref[name]:>6}  {name}", width, " " * 8))
    return lines


def _submodel_rows(entry: dict[int, dict[str, Any]], firsts: list[int]) -> list[str]:
    """One row per distinct submodel (named after its first client): size and the check."""
    lines = [
        f"{'submodel':<12}  {'clients':>7}  {'r':>6}  {'params':>9}  {'MB':>8}  "
        f"{'MFLOP/step':>10}  {'max|diff|':>9}  {'tolerance':>9}"
    ]
    for first in firsts:
        e = entry[first]
        tol = "-" if e["tolerance"] is None else f"{e['tolerance']:.2g}"
        lines.append(
            f"{'client-' + str(first):<12}  {1 + len(e['shared_with']):>7}  "
            f"{e['capacity']:>6.4g}  {e['parameters']:>9}  {e['bytes'] / 1e6:>8.3f}  "
            f"{e['flops_per_step'] / 1e6:>10.2f}  {e['max_abs_diff']:>9.2g}  {tol:>9}"
        )
    return lines


def _accuracy_rows(
    manifest: dict[str, Any], entry: dict[int, dict[str, Any]], firsts: list[int], width: int
) -> list[str]:
    """One row per distinct submodel with its test accuracy and latency per runtime (none
    when there is neither an edge program nor a measured accuracy)."""
    edge = [k for k in ("pte", "onnx", "pte_int8") if any(entry[f].get(k) for f in firsts)]
    accuracy = manifest.get("accuracy") or {}
    if not (edge or accuracy.get("measured")):
        return []
    names = {"pte": "ET", "onnx": "ORT", "pte_int8": "int8"}
    lines = [""]
    lines.extend(
        _wrapped(
            f"test accuracy (%, {accuracy.get('sample', 'no sample')}) in PyTorch, "
            "ExecuTorch (ET), ONNX Runtime (ORT) and int8 ExecuTorch (int8); latency "
            "(us per sample at the largest batch timed)",
            width,
            "  ",
        )
    )
    head = f"{'submodel':<12}  {'PyTorch':>7}"
    for k in edge:
        head += f"  {names[k] + ' %':>7}  {names[k] + ' us':>7}"
    if "pte_int8" in edge:
        head += f"  {'int8 drop':>9}"
    lines.append(head)
    for first in firsts:
        e = entry[first]
        acc = e.get("accuracy") or {}
        row = f"{'client-' + str(first):<12}  {_percent(acc.get('pytorch')):>7}"
        for k in edge:
            record = e.get(k)
            shown = "failed" if record and "error" in record else _percent(acc.get(k))
            row += f"  {shown:>7}  {_micro(record):>7}"
        if "pte_int8" in edge:
            row += f"  {_percent(acc.get('int8_drop')):>9}"
        lines.append(row)
    return lines


def _first(client: dict[str, Any]) -> int:
    """The client whose files a manifest entry's client loads (the first sharing them)."""
    return min([client["client"], *client["shared_with"]])


# ---------------------------------------------------------------------------- loading back
def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    """The ``manifest.json`` of an export folder (JSON; :class:`ExportError` when it is missing
    or not an export manifest)."""
    path = Path(out_dir) / "manifest.json"
    manifest = _read_json(path, "export manifest")
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
    bound = record.get("max_batch")
    if isinstance(bound, int) and not isinstance(bound, bool) and bound >= 1:
        # the manifest's bound, when tighter than what the runtime reports
        program.max_batch = bound if program.max_batch is None else min(bound, program.max_batch)
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

    edge = _calibration_formats(formats, runs)
    exp = build(config)
    plan, index_sets, budgets = round0_assignment(exp)
    state = _state(exp)
    host = profile if profile is not None else probe_host()
    batch = int(config.algorithm.batch_size)
    inputs = exp.test.features[:CHECK_BATCH].to(torch.float32)
    rows: list[CalibrationRow] = []
    for group in _distinct(index_sets).values():
        sub = plan.submodel(group.index_set, state)
        sub.eval()
        capacity = budgets[group.first].capacity
        rows.extend(_calibration_rows(sub, group, capacity, edge, inputs, batch, host, runs))
    rows.sort(key=lambda r: (-r.capacity, r.clients[0], EDGE_FORMATS.index(r.format)))
    return Calibration(host, batch, torch.get_num_threads(), runs, rows)


def _calibration_formats(formats: str | Sequence[str], runs: int) -> list[str]:
    """The edge formats a calibration times, after checking them, ``runs`` and the packages
    they need."""
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
    return edge


def _calibration_rows(
    sub: nn.Module,
    group: _Submodel,
    capacity: float,
    edge: list[str],
    inputs: Tensor,
    batch: int,
    host: DeviceProfile,
    runs: int,
) -> list[CalibrationRow]:
    """One distinct submodel's rows, one per runtime in ``edge``: lowered in memory, loaded
    in its runtime and timed at ``batch`` (a runtime that cannot take it: its error)."""
    fwd = forward_flops(sub, batch) / batch
    step = training_step_flops(sub, batch) / batch
    common: dict[str, Any] = {
        "capacity": capacity,
        "clients": list(group.clients),
        "parameters": sum(p.numel() for p in sub.parameters()),
        "batch": batch,
        "forward_flops_per_sample": fwd,
        "predicted_s_per_sample": fwd / host.compute_flops,
        "train_step_flops_per_sample": step,
        "train_step_predicted_s_per_sample": step / host.compute_flops,
    }
    timed = batch_of(inputs, batch)
    rows = []
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
    return rows
