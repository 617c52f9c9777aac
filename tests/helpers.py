"""Helpers shared by the test files (one copy each; fixtures live in ``conftest.py``).

* state comparison: :func:`state_leaves`, :func:`state_tensors`, :func:`assert_same_state`;
* run output without what differs between two runs of one config: :func:`unclocked_rows`,
  :func:`comparable_results`; two runs of one config by equivalent routes:
  :func:`assert_runs_agree`;
* a backend that records and may tamper with client results: :class:`Recorder`,
  :func:`nan_update`, :func:`nan_where`;
* the float64 5-4-3 MLP problem the algorithms' by-hand tests share: :func:`toy_mlp`,
  :func:`toy_clients`, :func:`toy_simulation`, :func:`leaf`;
* the random quadratic bilevel problem of the hypergradient tests: :class:`Quadratic` with
  :func:`flat`, :func:`unflat`, :func:`rel_err`; :class:`TwoVariables`, a module holding x and y
  for toy problems written as losses;
* scripts: :func:`load_script`, :func:`run_script`; the aten operations a call dispatches:
  :class:`OpLog`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from radbo._torch_private import TorchDispatchMode
from radbo.client import ClientBudget, ClientResult, ClientRuntime, ClientTask
from radbo.models import MLP
from radbo.problem import ClientData
from radbo.simulation import SequentialBackend, Simulation
from radbo.tasks import HyperRepresentation
from radbo.typing import Params


# ------------------------------------------------------------------------------ scripts
def load_script(path: Path, name: str) -> ModuleType:
    """The script at ``path`` (a benchmark, not a package module) imported as ``name``; it is
    registered in ``sys.modules`` because dataclasses in a script look their module up there."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


#: ``torch.compile``'s CPU backend (inductor) builds C++: a test that compiles skips without it
requires_compiler = pytest.mark.skipif(
    not any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")),
    reason="torch.compile's CPU backend (inductor) needs a C++ compiler",
)


def count_applies(monkeypatch: pytest.MonkeyPatch, function: type) -> list[int]:
    """A spy on a custom ``torch.autograd.Function``'s ``apply``: the returned list's one
    element counts its calls for the rest of the test (the functions still run)."""
    count = [0]
    original = function.apply  # type: ignore[attr-defined]

    def counted(*args: object) -> Tensor:
        count[0] += 1
        return original(*args)

    monkeypatch.setattr(function, "apply", counted)
    return count


def run_script(*args: str) -> str:
    """The standard output of ``python ARGS`` run from the repository root on one intra-op
    thread (a benchmark at its smallest), which must exit 0."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


class OpLog(TorchDispatchMode):
    """The aten operations dispatched while it is on, by name, in order: ``names`` all of
    them, ``launched`` those that are not views (an operation whose schema returns an alias of
    an input and mutates nothing launches no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.launched: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.names.append(func.name())
        schema = func._schema
        if schema.is_mutable or all(a.alias_info is None for a in schema.returns):
            self.launched.append(func.name())
        return func(*args, **(kwargs or {}))


# ------------------------------------------------------------------------------ state equality


def state_leaves(value: object, path: str = "") -> dict[str, object]:
    """Every leaf of a (nested dataclass / dict / sequence) state, keyed by its path
    ``field/name`` (the keys :func:`radbo.checkpoint.state_to_tensors` gives a state's dicts
    of tensors)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items: list[tuple[object, object]] = [
            (f.name, getattr(value, f.name)) for f in dataclasses.fields(value)
        ]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple):
        items = list(enumerate(value))
    else:
        return {path: value}
    out: dict[str, object] = {}
    for k, v in items:
        out.update(state_leaves(v, f"{path}/{k}" if path else str(k)))
    return out


def state_tensors(value: object) -> dict[str, Tensor]:
    """Every tensor of a state (dataclasses, mappings, sequences), keyed as in
    :func:`state_leaves`."""
    return {k: v for k, v in state_leaves(value).items() if isinstance(v, Tensor)}


def same_tensor(a: Tensor, b: Tensor) -> bool:
    """Bitwise, dtype and shape included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def assert_same_state(a: object, b: object, *, tensors_only: bool = False) -> None:
    """``a`` and ``b`` hold the same leaves: tensors bitwise (dtype and shape included), other
    leaves equal (with ``tensors_only``, the tensors alone are compared).

    Bitwise, since the runs compared run the same client work in the same order with the same
    kernels and one intra-op thread (one process, worker processes forked from it, Flower nodes
    inheriting its environment, or a resumed checkpoint), on tensors that keep their shapes
    and strides; any difference is a fault, not rounding. The tests that compare whole runs
    are marked ``float_sensitive`` all the same: they hold only while every kernel computes
    equal inputs alike whatever their memory layout after the trip, which the marker checks
    under each kernel."""
    la, lb = state_leaves(a), state_leaves(b)
    if tensors_only:
        la = {k: v for k, v in la.items() if isinstance(v, Tensor)}
        lb = {k: v for k, v in lb.items() if isinstance(v, Tensor)}
    assert any(isinstance(v, Tensor) for v in la.values()), "a state without tensors"
    assert la.keys() == lb.keys()
    for k, va in la.items():
        vb = lb[k]
        if isinstance(va, Tensor):
            assert isinstance(vb, Tensor) and same_tensor(va, vb), k
        else:
            assert va == vb, k


# ------------------------------------------------------------------------------ run output


def assert_runs_agree(a: Any, b: Any, *, rtol: float, atol: float) -> None:
    """Two results of one config computed by equivalent routes (e.g. a stacked cohort's
    layers batched two ways): ledgers equal, every per-round metric but the wall-clock times
    equal (floats to ``rtol`` relative, ``atol`` absolute), x and y to the same tolerance."""
    assert a.ledger == b.ledger
    for ra, rb in zip(a.rounds, b.rounds, strict=True):
        assert ra.keys() == rb.keys()
        for k in ra:
            if "wall" in k:
                continue
            if isinstance(ra[k], float):
                assert ra[k] == pytest.approx(rb[k], rel=rtol, abs=atol, nan_ok=True), k
            else:
                assert ra[k] == rb[k], k
    for part in ("x", "y"):
        ta, tb = getattr(a.state, part), getattr(b.state, part)
        for name in ta:
            torch.testing.assert_close(ta[name], tb[name], rtol=rtol, atol=atol)


def unclocked_rows(rows: Iterable[dict]) -> list[dict]:
    """Per-round rows without the measured wall time (everything else is deterministic)."""
    return [{k: v for k, v in r.items() if k != "wall_time_s"} for r in rows]


def comparable_results(folder: Path, *, drop: tuple[str, ...] = ("config",)) -> dict:
    """``folder``'s results.json without what differs between two runs of one config: the
    rows' wall-clock times and the top-level keys ``drop`` (the config names the output
    folder), in the run and in its paired baseline."""
    results = json.loads((folder / "results.json").read_text())
    for part in (results, results.get("baseline") or {}):
        for key in drop:
            part.pop(key, None)
        for row in part.get("rounds", []):
            row.pop("wall_time_s")
    return results


# ------------------------------------------------------------------------------ backends


class Recorder(SequentialBackend):
    """The sequential backend, keeping every task it ran and every result it handed back.

    With ``change``, each result is replaced by ``change(task, result)`` unless that is
    ``None`` (spoiled updates, lost or rejected replies)."""

    def __init__(
        self, change: Callable[[ClientTask, ClientResult], ClientResult | None] | None = None
    ) -> None:
        self.change = change
        self.calls: list[tuple[list[ClientTask], list[ClientResult]]] = []

    def run(self, work, runtime, meter, tasks):  # type: ignore[no-untyped-def]
        results = super().run(work, runtime, meter, tasks)
        if self.change is not None:
            out = []
            for task, result in zip(tasks, results, strict=True):
                changed = self.change(task, result)
                out.append(result if changed is None else changed)
            results = out
        self.calls.append((list(tasks), results))
        return results

    @property
    def tasks(self) -> list[ClientTask]:
        return [t for ts, _ in self.calls for t in ts]

    @property
    def results(self) -> list[ClientResult]:
        return [r for _, rs in self.calls for r in rs]

    @property
    def task_at(self) -> dict[tuple[int, str, int], ClientTask]:
        """Tasks by ``(round, phase, client)``."""
        return {(t.round, t.phase, t.client): t for t in self.tasks}


def nan_update(result: ClientResult) -> ClientResult:
    """``result`` with every tensor of its update NaN (the engine rejects it)."""
    return dataclasses.replace(
        result, update={k: torch.full_like(t, float("nan")) for k, t in result.update.items()}
    )


def nan_where(
    which: Callable[[ClientTask], bool],
) -> Callable[[ClientTask, ClientResult], ClientResult | None]:
    """A :class:`Recorder` change: NaN updates for the tasks ``which`` picks."""
    return lambda task, result: nan_update(result) if which(task) else None


# ------------------------------------------------------------- the algorithms' toy MLP problem

TOY_TASK = HyperRepresentation(inner_l2=0.1)


@dataclass
class ToyMLP:
    """A float64 5-4-3 MLP (x = hidden layer, y = head) and its random examples."""

    model: MLP
    features: Tensor
    labels: Tensor
    state: dict[str, Tensor]
    x: dict[str, Tensor]
    y: dict[str, Tensor]


def toy_mlp(num_examples: int) -> ToyMLP:
    """The model initialised from seed 0, ``num_examples`` random 5-feature examples with
    labels in {0, 1, 2} drawn from a generator seeded 0."""
    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = MLP(5, [4], 3).double()
    features = torch.randn(num_examples, 5, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 3, (num_examples,), generator=gen)
    state = model.state_dict()
    x = {k: state[k] for k in model.outer_param_names()}
    y = {k: state[k] for k in model.inner_param_names()}
    return ToyMLP(model, features, labels, state, x, y)


def toy_clients(num_clients: int, *, same_data: bool = False) -> list[ClientData]:
    """Client c holds examples 20c..20c+11 (inner) and 20c+12..20c+19 (outer), or with
    ``same_data`` every client holds examples 0..11 and 12..19."""
    return [
        ClientData(
            inner=torch.arange(0, 12) if same_data else torch.arange(20 * c, 20 * c + 12),
            outer=torch.arange(12, 20) if same_data else torch.arange(20 * c + 12, 20 * c + 20),
        )
        for c in range(num_clients)
    ]


def toy_simulation(
    algo: Any,
    toy: ToyMLP,
    clients: list[ClientData],
    *,
    budgets: list[ClientBudget] | None = None,
    seed: int = 0,
    **kw: Any,
) -> Simulation:
    """``algo`` on ``clients`` of the toy problem (:data:`TOY_TASK`), unlimited budgets unless
    given; ``kw`` goes to :class:`Simulation` (a backend, say)."""
    return Simulation(
        algorithm=algo,
        runtime=ClientRuntime(TOY_TASK, toy.features, toy.labels, toy.model),
        clients=clients,
        budgets=budgets if budgets is not None else [ClientBudget()] * len(clients),
        shapes={k: t.shape for k, t in toy.state.items()},
        seed=seed,
        **kw,
    )


def leaf(d: dict[str, Tensor]) -> dict[str, Tensor]:
    """Detached copies that require grad: the inputs of a by-hand autograd computation."""
    return {k: t.detach().clone().requires_grad_(True) for k, t in d.items()}


# -------------------------------------------------------- the hypergradients' random quadratic

DTYPE = torch.float64
X_SHAPES: dict[str, tuple[int, ...]] = {"a": (3,), "b": (2, 2)}
Y_SHAPES: dict[str, tuple[int, ...]] = {"w": (4,), "u": (2, 3)}
P = sum(math.prod(s) for s in X_SHAPES.values())  # dim x = 7
Q = sum(math.prod(s) for s in Y_SHAPES.values())  # dim y = 10
A_EIGS = torch.linspace(0.5, 10.0, Q, dtype=DTYPE)  # κ = 20, L = 10


def flat(params: Params, lead: int = 0) -> Tensor:
    """The tensors of ``params`` flattened and concatenated, keeping ``lead`` leading dims."""
    return torch.cat([t.reshape(*t.shape[:lead], -1) for t in params.values()], dim=-1)


def unflat(vec: Tensor, shapes: dict[str, tuple[int, ...]]) -> Params:
    out, start = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = vec[start : start + n].reshape(shape)
        start += n
    return out


def rel_err(estimate: Params, reference: Tensor) -> float:
    return float(torch.linalg.norm(flat(estimate) - reference) / torch.linalg.norm(reference))


@dataclass(frozen=True)
class Quadratic:
    """A random quadratic bilevel problem in float64 with named, multi-shaped x and y and a
    non-identity SPD inner Hessian A (eigenvalues evenly spaced in [0.5, 10], condition number
    20), written out in the docstring of ``tests/hypergrad/test_hypergrad.py``."""

    A: Tensor
    B: Tensor
    c: Tensor
    C: Tensor
    d: Tensor
    e: Tensor
    D: Tensor
    E: Tensor
    rho: float = 0.3

    @staticmethod
    def random(seed: int = 0) -> Quadratic:
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=gen, dtype=DTYPE)

        basis, _ = torch.linalg.qr(randn(Q, Q))
        a = basis @ torch.diag(A_EIGS) @ basis.T
        m = randn(P, P)
        return Quadratic(
            A=(a + a.T) / 2,
            B=randn(Q, P),
            c=randn(Q),
            C=randn(5, Q),
            d=randn(5),
            e=randn(P),
            D=m @ m.T / P,
            E=randn(Q, P) / 2,
        )

    def inner(self, x: Params, y: Params) -> Tensor:
        xf, yf = flat(x), flat(y)
        return 0.5 * yf @ self.A @ yf - yf @ self.B @ xf + self.c @ yf + 0.5 * self.rho * xf @ xf

    def outer(self, x: Params, y: Params) -> Tensor:
        xf, yf = flat(x), flat(y)
        r = self.C @ yf - self.d
        return 0.5 * r @ r + self.e @ xf + 0.5 * xf @ self.D @ xf + yf @ self.E @ xf

    def y_star(self, xf: Tensor) -> Tensor:
        return torch.linalg.solve(self.A, self.B @ xf - self.c)

    def grad_y_f(self, xf: Tensor, yf: Tensor) -> Tensor:
        return self.C.T @ (self.C @ yf - self.d) + self.E @ xf

    def surrogate(self, xf: Tensor, yf: Tensor, damping: float = 0.0) -> Tensor:
        """Closed form of ∇_x f − ∇²_xy g [∇²_yy g + λI]⁻¹ ∇_y f at any (x, y)."""
        grad_x_f = self.e + self.D @ xf + self.E.T @ yf
        h = self.A + damping * torch.eye(Q, dtype=DTYPE)
        return grad_x_f + self.B.T @ torch.linalg.solve(h, self.grad_y_f(xf, yf))

    def point(self, seed: int = 1) -> tuple[Params, Params]:
        """A random x and y = y*(x), as named multi-shaped tensors (no grad)."""
        gen = torch.Generator().manual_seed(seed)
        xf = torch.randn(P, generator=gen, dtype=DTYPE)
        return unflat(xf, X_SHAPES), unflat(self.y_star(xf), Y_SHAPES)


class TwoVariables(nn.Module):
    """Holds x and y (``d``-vectors) so that the engine can build index sets and skeletons for
    a toy problem written as losses of ``x["x"]`` and ``y["y"]``."""

    def __init__(self, d: int = 2) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(d))
        self.y = nn.Parameter(torch.zeros(d))


# ------------------------------------------------------------------ test-side time limits
@contextlib.contextmanager
def time_limit(seconds: float, on_expiry: Callable[[], None] | None = None) -> Iterator[None]:
    """Fail with TimeoutError, rather than hang, when the block runs longer than ``seconds``
    (main thread only: SIGALRM). A blocking call is interrupted: Python runs the handler and
    lets its exception through (PEP 475). ``on_expiry`` runs first (e.g. to kill processes a
    clean-up would otherwise wait on)."""

    def expire(signum: int, frame: object) -> None:
        if on_expiry is not None:
            on_expiry()
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
