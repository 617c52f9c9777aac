"""radbo's shape: the import layers, and an algorithm added without touching radbo.

1. Every import in ``radbo/`` (module level or inside a function) goes from a higher layer to a
   lower one (or stays inside its own package): no package imports one above it, so there is
   no import cycle between packages. Inside a package, the modules' imports form no cycle
   either (as ``simfbo.py`` <-> ``shrofbo.py`` once did).
2. A toy algorithm defined and registered in this file alone runs through ``radbo.run`` from a
   plain config mapping, on the sequential and the batched backend, and checkpoints -- adding
   an algorithm is its file plus its registration, nothing else.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic import Field

import radbo
from radbo.aggregation import apply_step, coverage_weighted_mean
from radbo.algorithms import ALGORITHMS, AlgorithmConfig, Wiring
from radbo.algorithms.base import AlgorithmBase, clone
from radbo.autodiff import loss_grads, scalar
from radbo.client import (
    ClientResult,
    ClientRuntime,
    ClientTask,
    ClientWork,
    Cohort,
    Phase,
    Prepared,
)
from radbo.config import ConfigError, parse_config
from radbo.loops import Work
from radbo.masks.index import extract
from radbo.typing import IndexSet, Params

ROOT = Path(radbo.__file__).resolve().parent

#: The layers of radbo, lowest first. A module may import its own package and any package of a
#: lower layer; ``radbo/__init__.py`` (the public facade) and ``__main__`` may import anything.
LAYERS: list[set[str]] = [
    # _torch_private: every private PyTorch name radbo uses (see test_only_one_module_...)
    {
        "typing",
        "randomness",
        "registry",
        "version",
        "limits",
        "jsonio",
        "atomic",
        "errors",
        "schema",
        "threads",
        "allocator",
        "graphs",  # CUDA graphs of pure phase functions: torch alone
    }
    | {"_torch_private"},
    {"flops", "edge", "tomlfile"},
    {"autodiff", "problem", "cost", "checkpoint"},
    # loops: the local-step primitive (masks finished clients, marks repeated blocks for the
    # FLOP meter, counts the work) over autodiff's per-client helpers; below client, whose
    # Cohort.local_steps runs it, and hypergrad, whose solvers take their marks from it
    {"loops"},
    {"client", "data"},
    {"masks", "models", "tasks", "hypergrad"},
    {"aggregation", "devices"},
    {"algorithms", "simulation"},
    {"config", "report"},
    {"experiment", "docs"},  # docs: the README's configuration reference from the config classes
    {"export"},
    {"flower"},
    {"cli"},  # `radbo flower partition` writes node data
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def node(module: str) -> str:
    """The package (or root module) a dotted ``radbo.x.y`` module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports_of(path: Path, submodules: bool = False) -> list[str]:
    """Every radbo module ``path`` imports, at any depth of the file. With ``submodules``,
    ``from radbo.pkg import name`` is the module ``radbo.pkg.name`` when ``name`` is one (the
    module that import needs), else ``radbo.pkg``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(("radbo", *path.relative_to(ROOT).with_suffix("").parts))
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            found += [a.name for a in n.names if a.name.split(".")[0] == "radbo"]
        elif isinstance(n, ast.ImportFrom):
            if n.level:  # relative import: resolve against this module
                base = package.rsplit(".", n.level)[0]
                module = f"{base}.{n.module}" if n.module else base
            else:
                module = n.module or ""
            if module == "radbo":  # from radbo import jsonio: the modules named
                found += [f"radbo.{a.name}" for a in n.names]
            elif module.split(".")[0] == "radbo" and submodules:
                folder = ROOT.joinpath(*module.split(".")[1:])
                for a in n.names:
                    sub = (folder / f"{a.name}.py").is_file() or (folder / a.name).is_dir()
                    found.append(f"{module}.{a.name}" if sub else module)
            elif module.split(".")[0] == "radbo":
                found += [module]
    return found


def test_every_import_goes_down_the_layers() -> None:
    files = sorted([*ROOT.rglob("*.py"), *ROOT.rglob("*.pyi")])
    seen_nodes = set()
    problems = []
    for path in files:
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("__init__.py", "__init__.pyi", "__main__.py"):
            continue
        here = rel.parts[0].removesuffix(".pyi").removesuffix(".py")
        seen_nodes.add(here)
        assert here in LAYER, f"{rel}: package {here!r} has no layer in LAYERS"
        for module in imports_of(path):
            there = node(module)
            if there == here:
                continue
            if there not in LAYER or LAYER[there] >= LAYER[here]:
                problems.append(
                    f"{rel} imports {module} (layer {LAYER.get(there)} >= {LAYER[here]})"
                )
    assert not problems, "\n".join(problems)
    assert seen_nodes == set(LAYER), (
        f"LAYERS lists packages that do not exist: {set(LAYER) - seen_nodes}"
    )


def test_the_layer_check_sees_lazy_imports(tmp_path: Path) -> None:
    source = "def f():\n    from radbo.experiment import run\n    import radbo.cli\n"
    path = ROOT / "_probe.py"
    try:
        path.write_text(source)
        assert imports_of(path) == ["radbo.experiment", "radbo.cli"]
    finally:
        path.unlink()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_torch_names(path: Path) -> list[str]:
    """The private PyTorch names ``path`` uses: imports of a module with a ``_``-component
    under ``torch`` (``torch.utils._pytree``, ``torch._C``), names imported with a leading
    ``_`` from ``torch``, and attributes ``torch._x`` / ``torch.utils._x`` written out."""
    found = []
    for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(n, ast.Import):
            modules = [a.name for a in n.names]
            names: list[str] = []
        elif isinstance(n, ast.ImportFrom) and not n.level:
            modules, names = [n.module or ""], [a.name for a in n.names]
        elif isinstance(n, ast.Attribute):
            chain = [n.attr]
            base: ast.expr = n.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id == "torch":
                dotted = ".".join(["torch", *reversed(chain)])
                if any(_private(p) for p in chain):
                    found.append(dotted)
            continue
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] != "torch":
                continue
            if any(_private(p) for p in parts[1:]):
                found.append(module)
            found += [f"{module}.{a}" for a in names if _private(a)]
    return sorted(set(found))


def test_only_one_module_uses_private_torch_names() -> None:
    """Private PyTorch APIs live in radbo/_torch_private.py, each with a tested assumption
    (tests/test_torch_private.py); no other module of radbo reaches for one."""
    problems = {
        str(path.relative_to(ROOT)): names
        for path in sorted(ROOT.rglob("*.py"))
        if path.name != "_torch_private.py" and (names := private_torch_names(path))
    }
    assert not problems, problems


def test_the_private_torch_check_sees_every_form(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import torch\n"
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_flatten\n"
        "from torch.utils import _pytree, flop_counter\n"
        "key = torch._C.DispatchKey\n"
        "public = torch.utils.flop_counter.FlopCounterMode, torch.__version__\n",
        encoding="utf-8",
    )
    assert private_torch_names(source) == [
        "torch._C",
        "torch._C.DispatchKey",
        "torch._dynamo",
        "torch.utils._pytree",
    ]


def module_name(path: Path) -> str:
    """``radbo.x.y`` for ``radbo/x/y.py`` (``radbo.x`` for ``radbo/x/__init__.py``)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("radbo", *parts))


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles a depth-first search of ``graph`` meets (each as its path, first node
    repeated at the end)."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for other in sorted(graph[module]):
            if state.get(other) == 1:
                found.append([*path[path.index(other) :], other])
            elif other not in state:
                visit(other)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def package_import_graph() -> dict[str, set[str]]:
    """Each module of a radbo package and the modules of the same package it imports (at any
    depth of the file; ``from radbo.pkg import sub`` as ``radbo.pkg.sub``; ``radbo.pkg``
    alone is the package's ``__init__``)."""
    # root modules are packages of their own: the layer test covers them
    # a package's __init__.pyi declares its lazily imported public names: its imports count
    paths = [p for p in sorted([*ROOT.rglob("*.py"), *ROOT.rglob("*.pyi")]) if p.parent != ROOT]
    graph = {module_name(p): set[str]() for p in paths}
    for path in paths:
        module = module_name(path)
        graph[module] |= {  # |=: a package's __init__.py and __init__.pyi are one module
            m
            for m in imports_of(path, submodules=True)
            if m in graph and node(m) == node(module) and m != module
        }
    return graph


def test_no_import_cycle_inside_a_package() -> None:
    cycles = import_cycles(package_import_graph())
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle_inside_a_package() -> None:
    """The check sees the lazy import ``simfbo.py`` once made of ``shrofbo.py``."""
    graph = package_import_graph()
    assert "radbo.algorithms.simfbo" in graph["radbo.algorithms.shrofbo"]
    graph["radbo.algorithms.simfbo"] = {
        *graph["radbo.algorithms.simfbo"],
        "radbo.algorithms.shrofbo",
    }
    assert import_cycles(graph) == [
        ["radbo.algorithms.shrofbo", "radbo.algorithms.simfbo", "radbo.algorithms.shrofbo"]
    ]


#: The calls that make a file by writing a temporary one and renaming it: only
#: :mod:`radbo.atomic` makes them (``radbo.flower.worker`` renames its PID file with
#: ``Path.replace``: it imports nothing but the standard library).
RENAMING_CALLS = {("os", "replace"), ("os", "rename"), ("tempfile", "mkstemp")}


def test_one_atomic_write() -> None:
    """Every file radbo creates by temporary file + rename goes through radbo.atomic."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "atomic.py":
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and (n.value.id, n.attr) in RENAMING_CALLS
            ):
                found.append(f"{path.relative_to(ROOT)}:{n.lineno}: {n.value.id}.{n.attr}")
    assert not found, "\n".join(found)


def test_the_client_side_is_built_in_one_place() -> None:
    """A run's :class:`ClientRuntime` and its model's structure plan are made by
    :mod:`radbo.experiment.clientside` alone: the simulation, a Flower node with its own data
    and the export all build their client side through it (issue 29 item 4)."""
    builder = ROOT / "experiment" / "clientside.py"
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == builder:
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(n, ast.Call):
                continue
            func = n.func
            name = getattr(func, "id", None) or getattr(func, "attr", None)
            if name in ("ClientRuntime", "StructurePlan"):
                found.append(f"{path.relative_to(ROOT)}:{n.lineno} calls {name}(...)")
    assert not found, "\n".join(found)


# ------------------------------------------------------------------- a toy algorithm, here only
@dataclass(frozen=True)
class ToyState:
    x: Params
    y: Params
    buffers: Params
    round: int = 0


@ALGORITHMS.register
class ToyConfig(AlgorithmConfig):
    """A toy first-order method: each client takes ``local_steps`` SGD steps on y and one
    gradient of f in x at its last y (ignoring y's dependence on x); the server averages."""

    name: Literal["toy_alternating"]
    inner_lr: float = Field(0.3, gt=0)
    outer_lr: float = Field(0.1, gt=0)
    local_steps: int = Field(3, ge=1)
    batch_size: int = Field(16, ge=1)
    outer_batch_size: int = Field(16, ge=1)

    @property
    def local_steps_default(self) -> int:
        return self.local_steps

    def build(self, wiring: Wiring) -> Toy:
        return self.bind(Toy, wiring)


class Toy(ToyConfig, AlgorithmBase):
    def init(self, x: Params, y: Params, buffers: Params) -> ToyState:
        return ToyState(clone(x), clone(y), clone(buffers))

    def phases(self) -> Sequence[Phase[ToyState]]:
        return (
            Phase("train", self.broadcast, ClientWork(self.run_client, self.prepare), self.server),
        )

    def broadcast(self, state: ToyState, index_set: IndexSet, slot: int = 0) -> Params:
        return extract(self.model_state(state), index_set)

    def prepare(self, runtime: ClientRuntime, task: ClientTask) -> Prepared:
        gen = task.generator()
        steps = torch.stack(
            [
                runtime.sampler.inner(task.data, self.batch_size, gen)
                for _ in range(self.local_steps)
            ]
        )
        outer = runtime.sampler.outer(task.data, self.outer_batch_size, gen)
        return Prepared(data={"outer": outer}, steps={"inner": steps}, num_steps=self.local_steps)

    def run_client(self, runtime: ClientRuntime, cohort: Cohort) -> list[ClientResult]:
        module = cohort.module(runtime)
        x = cohort.params(self.outer_names)
        y = cohort.params(self.inner_names, clone=True)
        buffers = cohort.params(self.buffer_names, clone=True)
        start = {n: t.clone() for n, t in y.items()}

        def step(t: int, y: Params) -> tuple[Params, Work]:  # one SGD step on g, every client
            batch = runtime.batch(cohort.step_data("inner", t))
            y_var = {n: p.requires_grad_(True) for n, p in y.items()}
            loss = cohort.loss(runtime.problem.inner_loss, module, x, y_var, buffers, batch)
            grads = torch.autograd.grad(scalar("g", loss, cohort.lead), list(y_var.values()))
            stepped = {
                n: (p - self.inner_lr * g).detach()
                for (n, p), g in zip(y_var.items(), grads, strict=True)
            }
            return stepped, Work(n_grad=1)

        # the framework's loop: masks clients that finished, marks the step for the FLOP meter
        # and counts the gradients per client
        steps = cohort.local_steps(step, y, name="toy.step")
        y = steps.carry
        last = runtime.batch(cohort.step_data("inner", cohort.max_steps - 1))
        outer, _ = cohort.bind(
            runtime.problem, module, buffers, last, runtime.batch(cohort.data("outer"))
        )
        gx, _ = loss_grads(
            outer,
            "f",
            tuple(x),
            tuple(x.values()),
            tuple(y),
            tuple(y.values()),
            wrt_x=True,
            wrt_y=False,
            lead=cohort.lead,
        )
        update = {
            **dict(zip(x, gx, strict=True)),
            **{n: (start[n] - y[n]) / self.inner_lr for n in y},
        }
        return cohort.replies(update, n_grad=[n + 1 for n in steps.n_grad])

    def server(self, state, results, index_sets, weights):
        shapes = {n: t.shape for n, t in {**state.x, **state.y}.items()}
        agg = coverage_weighted_mean([r.update for r in results], index_sets, shapes, weights)
        x = apply_step(state.x, agg, self.outer_lr)
        y = apply_step(state.y, agg, self.inner_lr)
        return replace(state, x=x, y=y, round=state.round + 1), {}


TOY = {
    "rounds": 6,
    "eval_every": 3,
    "seed": 1,
    "fleet": {"num_clients": 4, "capacities": [1.0, 0.5]},
    "model": {"name": "mlp", "hidden": [32]},
    "partition": {"kind": "iid"},
    "algorithm": {"name": "toy_alternating", "local_steps": 3},
}


@pytest.mark.float_sensitive
def test_a_toy_algorithm_registered_in_a_test_runs_through_radbo_run(tmp_path: Path) -> None:
    cfg = parse_config(TOY)
    assert isinstance(cfg.algorithm, ToyConfig) and cfg.estimator is None
    untrained = radbo.run(parse_config({**TOY, "rounds": 1}), progress=False, save=False)
    result = radbo.run(cfg, progress=False, save=False, output_dir=tmp_path)
    assert result.totals["communication_rounds"] == 6
    # it learns (float32, after training): test loss 2.3113 after 1 round, 2.2241 after 6, the
    # same to 1e-6 on default/avx2/avx512 kernels (also with MKL held to AVX2); seeds 2 and 3:
    # 2.2912 -> 2.2063, 2.2923 -> 2.2227. A drop of 0.07-0.09 against a spread of < 1e-6
    assert result.final["test_loss"] < untrained.final["test_loss"]
    batched = radbo.run(
        parse_config({**TOY, "runtime": {"backend": "batched", "dtype": "float64"}}),
        progress=False,
        save=False,
    )
    sequential = radbo.run(
        parse_config({**TOY, "runtime": {"dtype": "float64"}}), progress=False, save=False
    )
    # float64: the batched backend (batched products) may sum in another order than the
    # sequential one; over 6 rounds of 3 steps of reductions of at most a few thousand terms
    # that is ~1e-12 relative at worst (γ_2000 = 2.2e-13 per product, a few products deep);
    # measured 0 on default/avx2/avx512 kernels, 1.0e-16 with MKL held to AVX2; bound 1e-10
    for k, t in sequential.state.x.items():
        assert float((t - batched.state.x[k]).abs().max()) <= 1e-10 * float(t.abs().max())
    assert batched.ledger == sequential.ledger


def test_a_registered_toy_algorithm_gets_the_config_checks() -> None:
    with pytest.raises(ConfigError, match=r"algorithm.local_steps = 0: Input should be greater"):
        parse_config({**TOY, "algorithm": {"name": "toy_alternating", "local_steps": 0}})
    with pytest.raises(ConfigError, match="algorithm toy_alternating takes no estimator"):
        parse_config({**TOY, "estimator": {"name": "cg"}})
    with pytest.raises(ConfigError, match="'toy_alternating'"):  # listed among the known tags
        parse_config({**TOY, "algorithm": {"name": "nope"}})
