"""Programs an edge device runs without PyTorch: ExecuTorch (``.pte``) and ONNX (``.onnx``).

:func:`lower` turns a submodel (an ``nn.Module`` in eval mode, BatchNorm with its running
statistics) into the bytes of one of the :data:`EDGE_FORMATS`:

- ``"pte"``: ``torch.export`` of the forward, then ExecuTorch's
  ``to_edge_transform_and_lower`` with the XNNPACK partitioner (FP32; the XNNPACK delegate is
  what ExecuTorch runs on ARM and x86 CPUs). ``quantize="int8"`` first quantizes the exported
  graph with the XNNPACK quantizer (symmetric, per-channel int8 weights and activations,
  calibrated on the examples given), PyTorch 2 export quantization (``prepare_pt2e`` /
  ``convert_pt2e``). The batch dimension is dynamic up to ``max_batch`` (ExecuTorch plans its
  memory for that upper bound).
- ``"onnx"``: ``torch.onnx.export(..., dynamo=True)`` (opset 18 or later), batch dimension
  dynamic.

Either falls back to a static batch (the example's) when the batch cannot be made dynamic.

:class:`EdgeProgram` is such a program loaded **in its own runtime**
(``executorch.runtime.Runtime``, ``onnxruntime.InferenceSession``); calling it checks the
input's shape and dtype against what the program declares, then runs it there. A ``.pte``
takes batches of at most ``max_batch`` (ExecuTorch plans its memory for that bound; past it
the runtime answers only ``set_inputs() ... error 0x10``): a larger batch is refused before it
reaches the runtime, with an error naming ``max_batch``, and :meth:`EdgeProgram.run_batches`
runs a batch of any size in chunks. What the native runtime writes to stderr while lowering
and loading (ExecuTorch's CPU probe notes) is captured; lines other than that known noise are
written back, so real errors still show.
:func:`load_program` reads a file and loads it: with the size and SHA-256 the export manifest
recorded, it refuses a file that differs (truncated, damaged, another client's) before any
runtime parses it; without them it first loads and runs the file once in a child process, since
a damaged ``.pte`` can abort the ExecuTorch runtime (a corrupted flatbuffer ended a process with
SIGABRT here) and a child's crash must not end the caller. Files are flatbuffers and protobufs:
nothing is unpickled. :func:`measure_latency` times a program (median of N runs).

The packages are the optional extra ``radbo[edge]`` (``executorch``, ``onnx``, ``onnxscript``,
``onnxruntime``); :func:`require` says which are missing as one sentence.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn

from radbo.limits import LATENCY_RUNS

__all__ = [
    "EDGE_FORMATS",
    "FORMATS",
    "LATENCY_RUNS",
    "QUANTIZATIONS",
    "EdgeProgram",
    "ExportError",
    "Lowered",
    "digest",
    "load_program",
    "lower",
    "measure_latency",
    "missing_packages",
    "parse_formats",
    "require",
]

#: Quantizations :func:`lower` offers for ``.pte``.
QUANTIZATIONS: tuple[str, ...] = ("int8",)
#: Seconds a child process may take to load and run a file once (see :func:`load_program`).
PROBE_TIMEOUT_S = 300


class ExportError(ValueError):
    """The export cannot be written or an exported file cannot be used (a missing package, an
    unwritable folder, a truncated or replaced file); the message is one line."""


def parse_formats(formats: str | Sequence[str]) -> tuple[str, ...]:
    """The formats of ``"safetensors,pte,onnx"`` (or a sequence of names), in
    :data:`FORMATS` order without repeats; :class:`ExportError` for an unknown or empty one.

    >>> parse_formats("onnx, safetensors,onnx")
    ('safetensors', 'onnx')
    """
    names = formats.split(",") if isinstance(formats, str) else list(formats)
    wanted = {str(n).strip().lower() for n in names}
    unknown = sorted(w for w in wanted if w not in FORMATS)
    if unknown or not wanted:
        shown = ", ".join(repr(u) for u in unknown) if unknown else "none"
        raise ExportError(
            f"export error: format {shown} is not one radbo writes; use a comma-separated "
            f"list of {', '.join(FORMATS)}"
        )
    return tuple(f for f in FORMATS if f in wanted)


def missing_packages(fmt: str) -> list[str]:
    """The packages of ``radbo[edge]`` that ``fmt`` needs and this environment lacks."""
    kind = _PROGRAMS.get(fmt)
    needed = kind.packages if kind is not None else ()
    return [p for p in needed if importlib.util.find_spec(p) is None]


def require(fmt: str) -> None:
    """Raise :class:`ExportError` (one sentence) when a package ``fmt`` needs is missing."""
    missing = missing_packages(fmt)
    if missing:
        raise ExportError(
            f"export error: format {fmt!r} needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed; "
            "install them with: pip install 'radbo[edge]'"
        )


def digest(data: bytes) -> str:
    """Hex SHA-256 of ``data`` (what the manifest records per file)."""
    return hashlib.sha256(data).hexdigest()


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def first_line(err: BaseException) -> str:
    """``"TypeName: first line of the message"``: an exception as one line (terminal colour
    codes, which the ONNX exporter puts in its messages, removed)."""
    text = _ANSI.sub("", str(err)).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


#: Lines the native runtimes write to the process's stderr that are not errors: ExecuTorch's
#: CPU probe (cpuinfo) reports, once per process, the files it could not read.
_NATIVE_NOISE = re.compile(r"^\[cpuinfo_utils\.cpp:\d+\] ")
#: The most bytes of native stderr kept while it is captured.
_NATIVE_LOG_BYTES = 1 << 20


@contextlib.contextmanager
def _native_stderr() -> Iterator[None]:
    """Capture what native code (ExecuTorch's C++ runtime, XNNPACK) writes to file descriptor
    2 inside the block; afterwards write back every captured line but the known noise
    (:data:`_NATIVE_NOISE`), so real errors still reach stderr. Python's own ``sys.stderr``
    writes in the block go the same way."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 to capture: nothing to silence
        yield
        return
    import tempfile

    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read(_NATIVE_LOG_BYTES).decode("utf-8", "replace")
            kept = [ln for ln in text.splitlines() if ln.strip() and not _NATIVE_NOISE.match(ln)]
            if kept:
                print("\n".join(kept), file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the exporters' Python chatter (deprecation warnings, the ONNX registry's notes
    about torchvision) while lowering; the loggers' levels are restored afterwards."""
    names = ["torch.onnx", "torch.export", "torch._export", "torch.utils._pytree", "torchao"]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


# ---------------------------------------------------------------------------- lowering
@dataclass(frozen=True)
class Lowered:
    """A program :func:`lower` produced.

    Attributes:
        format: ``"pte"`` or ``"onnx"``.
        data: the file's bytes.
        dynamic_batch: whether the batch dimension is dynamic (else fixed at ``max_batch``).
        max_batch: the largest batch the program takes (``None``: no bound, ONNX dynamic).
        quantize: ``None`` (FP32) or ``"int8"``.
    """

    format: str
    data: bytes
    dynamic_batch: bool
    max_batch: int | None
    quantize: str | None = None


def _export(module: nn.Module, example: Tensor, max_batch: int | None) -> tuple[Any, bool]:
    """``torch.export`` of ``module``'s forward, batch dynamic (up to ``max_batch``) when it can
    be, else static at the example's batch."""
    if example.shape[0] >= 2:
        bounds = {"min": 1, "max": max_batch} if max_batch else {}
        shapes = ({0: torch.export.Dim("batch", **bounds)},)
        try:
            return torch.export.export(module, (example,), dynamic_shapes=shapes), True
        except Exception:  # a model that fixes its batch size: exported static below
            pass
    return torch.export.export(module, (example,)), False


def lower(
    module: nn.Module,
    example: Tensor,
    fmt: str,
    *,
    max_batch: int | None = None,
    quantize: str | None = None,
    calibration: Tensor | None = None,
) -> Lowered:
    """The ``fmt`` program of ``module``'s forward (see the module docstring).

    Args:
        module: the model; put in eval mode on a copy (the caller's module is not changed).
        example: an input batch (FP32); its batch size must be at least 2 for a dynamic batch.
        fmt: ``"pte"`` or ``"onnx"``.
        max_batch: the largest batch a ``.pte`` takes (default: the example's).
        quantize: ``"int8"`` for an int8 ``.pte`` (XNNPACK quantizer); ``None`` for FP32.
        calibration: inputs the int8 quantizer observes (default: ``example``).

    Raises:
        ExportError: ``fmt`` or ``quantize`` unknown, or a package missing.
        Exception: whatever the exporter raises for a model it cannot take.
    """
    kind = program_kind(fmt)
    if quantize is not None and quantize not in kind.quantizations:
        raise ExportError(
            f"export error: quantize={quantize!r} is not offered for {fmt!r}; radbo quantizes "
            f"only .pte programs, to {', '.join(QUANTIZATIONS)}"
        )
    require(fmt)
    model = _fp32_eval_copy(module)
    example = example.detach().to(torch.float32)
    with _native_stderr(), _quiet(), torch.no_grad():
        return kind.lower(model, example, max_batch, quantize, calibration)


def _fp32_eval_copy(module: nn.Module) -> nn.Module:
    import copy

    model = copy.deepcopy(module).to(torch.float32)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------- loading
class EdgeProgram:
    """A ``.pte`` or ``.onnx`` program loaded in its own runtime; call it on an FP32 batch.

    Build it with :func:`load_program` (a file) or :meth:`from_bytes` (bytes this process
    produced). Attributes: ``format``, ``name`` (the file, for messages), ``input_shape`` (one
    example, without the batch), ``dynamic_batch``, ``max_batch`` (``None``: no bound) and
    ``threads`` (the runtime's intra-op threads).

    Each edge format is a subclass registered under its name (:class:`PteProgram`,
    :class:`OnnxProgram`; :func:`program_kind`): it says how to lower a model to its file,
    load the file and run it, and what its runtime, file and packages are called.
    """

    #: the format's name (the file's suffix)
    format: ClassVar[str]
    #: the runtime that runs the file, and what the file is, for messages
    runtime_name: ClassVar[str]
    file_kind: ClassVar[str]
    #: the packages of ``radbo[edge]`` the format needs
    packages: ClassVar[tuple[str, ...]]
    #: the quantizations :func:`lower` offers for it
    quantizations: ClassVar[tuple[str, ...]] = ()
    #: why the format bounds its batch (appended to the refusal of a larger one)
    bound_note: ClassVar[str] = ""

    input_shape: tuple[int, ...]
    max_batch: int | None
    dynamic_batch: bool | None

    def __init__(self, data: bytes, name: str, *, threads: int | None = None) -> None:
        require(self.format)
        self.name = name
        self.threads = max(1, int(threads or torch.get_num_threads()))
        self._data = data
        try:
            self._load(data)
        except ExportError:
            raise
        except Exception as err:  # the runtime refuses the bytes: one line naming the file
            raise ExportError(
                f"export error: {name} is not a loadable {self.file_kind} "
                f"({self.runtime_name}: {first_line(err)})"
            ) from None

    @staticmethod
    def from_bytes(
        fmt: str, data: bytes, name: str = "<bytes>", *, threads: int | None = None
    ) -> EdgeProgram:
        """Load ``data`` in-process (bytes this process produced, e.g. by :func:`lower`)."""
        return program_kind(fmt)(data, name, threads=threads)

    @classmethod
    def lower(
        cls,
        model: nn.Module,
        example: Tensor,
        max_batch: int | None,
        quantize: str | None,
        calibration: Tensor | None,
    ) -> Lowered:
        """The program of ``model`` (FP32, eval mode, a copy) for :func:`lower`."""
        raise NotImplementedError

    def _load(self, data: bytes) -> None:
        """Load ``data`` in the runtime and set ``input_shape``, ``max_batch`` and
        ``dynamic_batch``."""
        raise NotImplementedError

    def _execute(self, x: Tensor) -> Tensor:
        """The runtime's output on the checked batch ``x``."""
        raise NotImplementedError

    def _failure_hint(self, err: Exception) -> str:
        """What to add to the message of a run the runtime refused (default: nothing)."""
        return ""

    def check_inputs(self, inputs: Tensor) -> None:
        """:class:`ExportError` (naming the file) unless ``inputs`` is an FP32 batch of the
        program's example shape within its batch bound."""
        shape = tuple(inputs.shape)
        if inputs.dtype != torch.float32 or shape[1:] != self.input_shape:
            raise ExportError(
                f"export error: {self.name} takes float32 inputs of shape "
                f"(batch, {', '.join(map(str, self.input_shape))}), got {inputs.dtype} "
                f"{shape}: the file is not this model's submodel"
            )
        batch = shape[0] if shape else 0
        if batch < 1:
            raise ExportError(f"export error: {self.name} got an empty batch {shape}")
        if self.fixed_batch and batch != self.max_batch:
            raise ExportError(
                f"export error: {self.name} was exported for batches of exactly "
                f"{self.max_batch}, got {batch}; pad the batch or use run_batches"
            )
        if self.max_batch is not None and batch > self.max_batch:
            why = self.bound_note
            raise ExportError(
                f"export error: {self.name} takes batches of at most max_batch = "
                f"{self.max_batch}{why}, got {batch}; split the batch (EdgeProgram.run_batches "
                "does) or export with a larger batch_size"
            )

    @property
    def fixed_batch(self) -> bool:
        """Whether the program takes only batches of exactly ``max_batch`` (a static batch:
        ONNX says so itself, a ``.pte`` when the manifest's ``dynamic_batch`` is false)."""
        return self.dynamic_batch is False and self.max_batch is not None

    def run_batches(self, inputs: Tensor) -> Tensor:
        """The program's output on a batch of any size: run in chunks of at most
        ``max_batch`` (the last padded with zeros, and its padding dropped, for a program of
        a fixed batch size)."""
        if self.max_batch is None or (inputs.shape[0] <= self.max_batch and not self.fixed_batch):
            return self(inputs)
        step = self.max_batch
        parts = []
        for start in range(0, inputs.shape[0], step):
            part = inputs[start : start + step]
            rows = part.shape[0]
            if self.fixed_batch and rows < step:
                pad = part.new_zeros((step - rows, *part.shape[1:]))
                part = torch.cat([part, pad])
            parts.append(self(part)[:rows])
        return torch.cat(parts)

    def __call__(self, inputs: Tensor) -> Tensor:
        """The program's output (logits) on ``inputs``, computed by the runtime."""
        self.check_inputs(inputs)
        x = inputs.detach().contiguous()
        try:
            return self._execute(x)
        except Exception as err:
            raise ExportError(
                f"export error: {self.name} failed to run ({self.runtime_name}: "
                f"{first_line(err)}){self._failure_hint(err)}"
            ) from None


_PROGRAMS: dict[str, type[EdgeProgram]] = {}
P = TypeVar("P", bound=type[EdgeProgram])


def _register(kind: P) -> P:
    _PROGRAMS[kind.format] = kind
    return kind


def program_kind(fmt: str) -> type[EdgeProgram]:
    """The :class:`EdgeProgram` class of the edge format ``fmt``; :class:`ExportError` for
    another name."""
    kind = _PROGRAMS.get(fmt)
    if kind is None:
        raise ExportError(f"export error: {fmt!r} is not an edge format; use one of {EDGE_FORMATS}")
    return kind


@_register
class PteProgram(EdgeProgram):
    """An ExecuTorch program (``.pte``, XNNPACK-delegated), run by the ExecuTorch runtime."""

    format = "pte"
    runtime_name = "ExecuTorch runtime"
    file_kind = "ExecuTorch program"
    packages = ("executorch",)
    quantizations = QUANTIZATIONS
    bound_note = " (ExecuTorch plans the program's memory for that bound)"

    @classmethod
    def lower(
        cls,
        model: nn.Module,
        example: Tensor,
        max_batch: int | None,
        quantize: str | None,
        calibration: Tensor | None,
    ) -> Lowered:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
            XnnpackPartitioner,
        )
        from executorch.exir import to_edge_transform_and_lower

        bound = max(int(max_batch or 0), int(example.shape[0]), 1)
        program, dynamic = _export(model, example, bound)
        if quantize == "int8":
            program = _quantize_int8(program, example, calibration, dynamic, bound)
        edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        data = bytes(edge.to_executorch().buffer)
        return Lowered("pte", data, dynamic, bound if dynamic else int(example.shape[0]), quantize)

    def _load(self, data: bytes) -> None:
        # the runtime's "experimental API" notice on first import; its CPU probe's notes on
        # stderr when the thread pool starts
        with _native_stderr(), _quiet():
            import executorch.extension.pybindings.portable_lib as portable
            from executorch.runtime import Runtime

            if portable._threadpool_get_thread_count() != self.threads:
                portable._unsafe_reset_threadpool(self.threads)  # no method runs meanwhile
            program = Runtime.get().load_program(data)
            method = program.load_method("forward") if "forward" in program.method_names else None
        if method is None:
            raise ExportError(
                f"export error: {self.name} has no 'forward' method "
                f"(methods: {sorted(program.method_names)})"
            )
        meta = method.metadata
        if meta.num_inputs() != 1 or meta.num_outputs() != 1:
            raise ExportError(
                f"export error: {self.name} takes {meta.num_inputs()} inputs and gives "
                f"{meta.num_outputs()} outputs; a radbo submodel takes 1 and gives 1"
            )
        sizes = tuple(int(s) for s in meta.input_tensor_meta(0).sizes())
        self._program, self._method = program, method
        self.input_shape = sizes[1:]
        self.max_batch: int | None = sizes[0]
        self._planned_batch = sizes[0]  # the bound ExecuTorch planned memory for
        # ExecuTorch keeps no flag for a dynamic dimension: the manifest records it
        self.dynamic_batch: bool | None = None

    def _execute(self, x: Tensor) -> Tensor:
        out = self._method.execute([x])[0]
        return out.clone() if isinstance(out, Tensor) else torch.as_tensor(out)

    def _failure_hint(self, err: Exception) -> str:
        if "set_inputs" not in str(err):
            return ""
        # ExecuTorch's only word for an input it cannot take (error 0x10: a resize past the
        # bound the program's memory was planned for)
        return (
            f"; the program was planned for batches of at most {self._planned_batch}: "
            "a larger batch, or another input shape, is refused there"
        )


@_register
class OnnxProgram(EdgeProgram):
    """An ONNX model (``.onnx``, exported by ``torch.onnx``'s dynamo exporter), run by ONNX
    Runtime's CPU provider."""

    format = "onnx"
    runtime_name = "ONNX Runtime"
    file_kind = "ONNX model"
    packages = ("onnx", "onnxscript", "onnxruntime")

    @classmethod
    def lower(
        cls,
        model: nn.Module,
        example: Tensor,
        max_batch: int | None,
        quantize: str | None,
        calibration: Tensor | None,
    ) -> Lowered:
        dynamic = example.shape[0] >= 2
        onnx_program = None
        if dynamic:
            with contextlib.suppress(Exception):  # static below
                onnx_program = torch.onnx.export(
                    model,
                    (example,),
                    dynamo=True,
                    dynamic_shapes=({0: torch.export.Dim("batch")},),
                    verbose=False,
                    input_names=["input"],
                    output_names=["logits"],
                )
        if onnx_program is None:
            dynamic = False
            onnx_program = torch.onnx.export(
                model,
                (example,),
                dynamo=True,
                verbose=False,
                input_names=["input"],
                output_names=["logits"],
            )
        assert onnx_program is not None, "torch.onnx.export(dynamo=True) returns an ONNXProgram"
        data = onnx_program.model_proto.SerializeToString()
        return Lowered("onnx", data, dynamic, None if dynamic else int(example.shape[0]))

    def _load(self, data: bytes) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3  # errors only
        session = onnxruntime.InferenceSession(
            data, sess_options=options, providers=["CPUExecutionProvider"]
        )
        inputs, outputs = session.get_inputs(), session.get_outputs()
        if len(inputs) != 1 or len(outputs) != 1:
            raise ExportError(
                f"export error: {self.name} takes {len(inputs)} inputs and gives "
                f"{len(outputs)} outputs; a radbo submodel takes 1 and gives 1"
            )
        shape = list(inputs[0].shape)
        if any(not isinstance(s, int) for s in shape[1:]):
            raise ExportError(
                f"export error: {self.name} declares input shape {shape}; a radbo submodel "
                "has a dynamic batch dimension only"
            )
        self._session, self._input_name = session, inputs[0].name
        self.input_shape = tuple(int(s) for s in shape[1:])
        self.dynamic_batch = not isinstance(shape[0], int)
        self.max_batch = None if self.dynamic_batch else int(shape[0])

    def _execute(self, x: Tensor) -> Tensor:
        result = self._session.run(None, {self._input_name: x.numpy()})[0]
        return torch.from_numpy(result.copy())


#: Formats a device runs without PyTorch: the registered programs, in registration order.
EDGE_FORMATS: tuple[str, ...] = tuple(_PROGRAMS)
#: Every format ``radbo export`` writes: the weights (``safetensors``) and the edge programs.
FORMATS: tuple[str, ...] = ("safetensors", *EDGE_FORMATS)


def _quantize_int8(
    program: Any, example: Tensor, calibration: Tensor | None, dynamic: bool, max_batch: int
) -> Any:
    """The exported ``program`` with int8 quantize/dequantize pairs the XNNPACK delegate fuses
    into int8 kernels: XNNPACK quantizer, symmetric per-channel weights, calibrated on
    ``calibration`` (observers run in eval mode)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    config = get_symmetric_quantization_config(is_per_channel=True)
    quantizer = XNNPACKQuantizer().set_global(config)
    prepared = prepare_pt2e(program.module(), quantizer)
    seen = example if calibration is None else calibration.detach().to(torch.float32)
    for start in range(0, max(1, seen.shape[0]), max_batch):
        prepared(seen[start : start + max_batch])
    converted = convert_pt2e(prepared)
    if dynamic:
        dim = torch.export.Dim("batch", min=1, max=max_batch)
        return torch.export.export(converted, (example,), dynamic_shapes=({0: dim},))
    return torch.export.export(converted, (example,))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ExportError(f"export error: cannot read {path}: {err.strerror or err}") from None


def load_program(
    path: str | Path,
    fmt: str | None = None,
    *,
    size: int | None = None,
    sha256: str | None = None,
    isolate: bool | None = None,
) -> EdgeProgram:
    """Load the ``.pte`` / ``.onnx`` file ``path`` in its runtime, refusing a bad file with one
    line naming it.

    Args:
        path: the file.
        fmt: ``"pte"`` or ``"onnx"``; default from the file's suffix.
        size, sha256: what the export manifest recorded for the file: a file of another size
            (truncated) or another SHA-256 (damaged, replaced by another client's) is refused
            before a runtime parses it.
        isolate: load and run the file once in a child process first, so that a runtime that
            aborts on a damaged file ends the child, not this process. Default: when no
            ``sha256`` vouches for the file.

    Raises:
        ExportError: the file is unreadable, differs from the manifest, crashes or is refused
            by the runtime, or is not a one-input, one-output model.
    """
    path = Path(path)
    fmt = fmt or path.suffix.lstrip(".").lower()
    if fmt not in EDGE_FORMATS:
        raise ExportError(
            f"export error: {path} is neither a .pte nor an .onnx file; pass fmt='pte' or 'onnx'"
        )
    require(fmt)
    data = _read(path)
    if size is not None and len(data) != size:
        raise ExportError(
            f"export error: {path} has {len(data)} bytes but the manifest records {size}: "
            "the file is truncated or was replaced; export again"
        )
    if sha256 is not None and digest(data) != sha256:
        raise ExportError(
            f"export error: {path} does not match the SHA-256 the manifest records: the file "
            "is damaged or was replaced; export again"
        )
    if isolate if isolate is not None else sha256 is None:
        _probe_in_child(path, fmt)
    return EdgeProgram.from_bytes(fmt, data, str(path))


def _probe_in_child(path: Path, fmt: str) -> None:
    """Load ``path`` and run it once on zeros in a child process; :class:`ExportError` when
    the child fails or crashes."""
    code = "import sys; from radbo.edge import _probe_main; sys.exit(_probe_main(sys.argv[1:]))"
    # the child imports this radbo, installed or not
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    try:
        child = subprocess.run(
            [sys.executable, "-c", code, fmt, str(path)],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise ExportError(
            f"export error: loading {path} in the {program_kind(fmt).runtime_name} took more than "
            f"{PROBE_TIMEOUT_S} s; the file is damaged or not a radbo export"
        ) from None
    if child.returncode == 0:
        return
    reply = [ln for ln in child.stdout.splitlines() if ln.startswith("radbo-probe: ")]
    if reply:
        raise ExportError(json.loads(reply[-1].removeprefix("radbo-probe: ")))
    if child.returncode < 0:
        import signal

        try:
            what = signal.Signals(-child.returncode).name
        except ValueError:
            what = f"signal {-child.returncode}"
        raise ExportError(
            f"export error: {path} crashed the {program_kind(fmt).runtime_name} ({what}) in a "
            f"child process: the file is damaged or not an {program_kind(fmt).file_kind}"
        )
    tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
    raise ExportError(
        f"export error: loading {path} in a child process failed (exit {child.returncode}: {tail})"
    )


def _probe_main(argv: Sequence[str]) -> int:
    """Child side of :func:`_probe_in_child`: exit 0 when the file loads and runs, else print
    the error line (JSON after ``radbo-probe:``) and exit 1."""
    fmt, path = argv
    try:
        program = EdgeProgram.from_bytes(fmt, _read(Path(path)), path, threads=1)
        program.run_batches(torch.zeros(1, *program.input_shape))
    except ExportError as err:
        print("radbo-probe: " + json.dumps(str(err)), flush=True)
        return 1
    return 0


# ---------------------------------------------------------------------------- latency
def batch_of(inputs: Tensor, batch: int) -> Tensor:
    """``batch`` examples: ``inputs`` repeated (row-wise) and cut to ``batch`` rows."""
    reps = math.ceil(batch / max(1, inputs.shape[0]))
    return inputs.repeat(reps, *([1] * (inputs.dim() - 1)))[:batch].contiguous()


def measure_latency(program: EdgeProgram, inputs: Tensor, runs: int = LATENCY_RUNS) -> float:
    """Median wall time (seconds) of ``runs`` calls of ``program`` on ``inputs``, after two
    untimed warm-up calls (``time.perf_counter``; the runtime's own threads, see
    :class:`EdgeProgram`)."""
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs = {runs!r}: must be an integer >= 1")
    program.check_inputs(inputs)
    for _ in range(2):
        program(inputs)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        program(inputs)
        times.append(time.perf_counter() - start)
    return float(statistics.median(times))
