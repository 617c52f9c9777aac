"""Every code block of the README runs, as written, in a test.

The fenced blocks are read from README.md. ``bash`` blocks run in bash (``set -e``) in a
working folder that has the repository's ``examples`` and ``.venv`` and small stand-ins for
the data sets the README names (``data/mnist``, ``data/omniglot``, ``data/a9a``), with this
environment's ``bin`` first on ``PATH``; ``python`` blocks run in a fresh interpreter there
(a block may register classes, as "Adding an algorithm" does); ``toml`` blocks are run
configs, which must validate and build (``radbo.build``) there, or a Flower connection
(``[superlink]``), which Flower's own reader must accept; ``text`` blocks are not code. Where
a block's result can be checked, :data:`PYTHON_CHECKS`, :data:`SHELL_CHECKS` and
:data:`CONFIG_CHECKS` check it.

A block that cannot run here says so in an HTML comment on the line before it:
``<!-- readme-test: skip (why) -->`` (never run: needs the network, other machines, daemons,
or is the suite itself) or ``<!-- readme-test: slow (why) -->`` (runs under ``-m slow``).
Every marker must give its reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LANGUAGES = {"bash", "python", "toml", "text"}
MARKER = re.compile(r"^<!-- readme-test: (?P<kind>\w+)(?: \((?P<reason>.*)\))? -->$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>\S*)\s*$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None = None  # "skip" or "slow"
    reason: str | None = None

    @property
    def id(self) -> str:
        return f"README.md:{self.line}:{self.lang}"


def read_blocks(text: str) -> list[Block]:
    """The fenced blocks of ``text`` with their markers (a marker is the line right before
    the fence, indented like it)."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = opening["indent"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"README.md:{i + 1}: a fenced block is not closed")
        code = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
        kind = reason = None
        if i > 0 and lines[i - 1].strip().startswith("<!-- readme-test"):
            found = MARKER.match(lines[i - 1].strip())
            if found is None:
                raise AssertionError(f"README.md:{i}: malformed marker {lines[i - 1].strip()!r}")
            kind, reason = found["kind"], found["reason"]
        blocks.append(Block(i + 1, opening["lang"] or "(none)", code, kind, reason))
        assert indent == "" or lines[end].startswith(indent), f"README.md:{end + 1}"
        i = end + 1
    return blocks


BLOCKS = read_blocks(README.read_text(encoding="utf-8"))
CODE = [b for b in BLOCKS if b.lang != "text"]


def params(lang: str) -> list:
    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.marker == "slow" else [])
        for b in CODE
        if b.lang == lang and b.marker != "skip"
    ]


# ----------------------------------------------------------------------------- the markers


def test_read_blocks_finds_indented_blocks_and_markers():
    text = textwrap.dedent(
        """\
        - item

          <!-- readme-test: slow (a minute) -->
          ```python
          x = 1
            y = 2
          ```

        ```bash
        echo hi
        ```
        """
    )
    assert read_blocks(text) == [
        Block(4, "python", "x = 1\n  y = 2\n", "slow", "a minute"),
        Block(9, "bash", "echo hi\n"),
    ]


def test_every_block_is_labelled_and_every_marker_says_why():
    assert len(CODE) >= 10
    problems = []
    for b in BLOCKS:
        if b.lang not in LANGUAGES:
            problems.append(f"{b.id}: label it bash, python, toml or text (not {b.lang})")
        if b.marker is not None and b.marker not in ("skip", "slow"):
            problems.append(f"{b.id}: unknown marker {b.marker!r} (skip or slow)")
        if b.marker is not None and not (b.reason or "").strip():
            problems.append(f"{b.id}: a {b.marker} marker needs its reason in parentheses")
        if b.marker is not None and b.lang == "text":
            problems.append(f"{b.id}: a text block runs nothing; drop its marker")
    assert not problems, "\n".join(problems)
    # the README runs more than it skips
    assert sum(b.marker == "skip" for b in CODE) < len(CODE) / 2


# ----------------------------------------------------------------------------- the working folder


def write_libsvm(path: Path, rows: int = 300, features: int = 123) -> None:
    """A small binary LIBSVM file shaped like a9a (0/1 features, labels +1/-1)."""
    import numpy as np

    rng = np.random.default_rng(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for _ in range(rows):
            cols = sorted(rng.choice(np.arange(1, features + 1), size=14, replace=False))
            label = "+1" if rng.random() < 0.3 else "-1"
            fh.write(label + " " + " ".join(f"{c}:1" for c in cols) + "\n")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    from radbo.data import write_digits_as_mnist
    from tests.tasks.test_few_shot import write_omniglot

    base = tmp_path_factory.mktemp("readme")
    (base / "examples").symlink_to(ROOT / "examples")
    (base / ".venv").symlink_to(Path(sys.executable).parent.parent)
    write_digits_as_mnist(base / "data" / "mnist")
    write_omniglot(base / "data" / "omniglot", alphabets=2, characters=4, images=4)
    write_libsvm(base / "data" / "a9a")
    return base


def environment(workdir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RADBO_WORKER_DIR": str(workdir / ".workers"),
        "FLWR_HOME": str(workdir / ".flwr"),
    }


def check_for(checks: dict[str, object], block: Block) -> list:
    return [check for key, check in checks.items() if key in block.code]


# ----------------------------------------------------------------------------- python blocks

#: Python run after a block (in its namespace) whose text contains the key.
PYTHON_CHECKS: dict[str, str] = {
    # the Python API: 10 RABO rounds of two communication rounds each, a real accuracy
    "result = radbo.run(cfg": """
assert result.totals["communication_rounds"] == 20, result.totals
assert 0.3 < result.final["test_accuracy"] <= 1.0, result.final
""",
    # the building blocks: 32 of 128 hidden units kept; a step count per device
    "plan.index_sets": """
assert sub.body[0].out_features == 32 and sub.body[0].in_features == 64
steps = [planner.budget(device, deadline_s=1.0).local_steps for device in fleet]
assert len(steps) == 4 and all(isinstance(s, int) and s >= 1 for s in steps)
""",
    # "Adding an algorithm": the toy learns (seed 0, float32: test accuracy 0.10 untrained,
    # 0.6546 after 10 rounds; the bound leaves 0.25 below that), its section validates and
    # refuses what it should, and it runs on the batched backend
    "toy_inner_sgd": """
import pytest
from radbo.config import ConfigError

assert result.final["test_accuracy"] > 0.4, result.final
assert result.totals["communication_rounds"] == 10
assert (config.algorithm.lr, config.algorithm.local_steps, config.estimator) == (0.3, 3, None)
with pytest.raises(ConfigError, match="local_steps"):
    radbo.parse_config({"algorithm": {"name": "toy_inner_sgd", "local_steps": 0}})
with pytest.raises(ConfigError, match="takes no estimator"):
    radbo.parse_config({"algorithm": {"name": "toy_inner_sgd"}, "estimator": {"name": "cg"}})
batched = radbo.parse_config(
    {"algorithm": {"name": "toy_inner_sgd"}, "rounds": 2, "runtime": {"backend": "batched"}}
)
assert radbo.run(batched, progress=False, save=False).totals["communication_rounds"] == 2
""",
    # Flower's simulation runtime: the 2 rounds asked for, a real accuracy
    "run_on_flower(config": """
assert len(result.rounds) == 2, len(result.rounds)
assert 0.0 < result.final["test_accuracy"] <= 1.0 and result.totals["bytes_up"] > 0
""",
}


@pytest.mark.parametrize("block", params("python"))
def test_python_block_runs(block: Block, workdir: Path):
    code = block.code + "".join(check_for(PYTHON_CHECKS, block))
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=workdir,
        env=environment(workdir),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"{block.id} failed:\n{done.stderr[-4000:]}"


# ----------------------------------------------------------------------------- shell blocks


def check_deploy_local(workdir: Path, stdout: str) -> None:
    import json

    out = workdir / "runs" / "flower-local"
    results = json.loads((out / "results.json").read_text())
    assert len(results["rounds"]) == 2 and 0.0 < results["final"]["test_accuracy"] <= 1.0
    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    assert (out / "app" / "pyproject.toml").is_file()
    assert sorted(p.name for p in (out / "nodes").iterdir()) == [f"client-{i}" for i in range(3)]
    assert {"superlink.log", "supernode-0.log", "run-1.log"} <= {
        p.name for p in (out / "logs").iterdir()
    }
    assert f"results: {out / 'results.json'}" in stdout


#: Checks of a shell block's results (by a text the block contains).
SHELL_CHECKS: dict[str, Callable[[Path, str], None]] = {
    "radbo flower deploy-local": check_deploy_local,
}


@pytest.mark.parametrize("block", params("bash"))
def test_shell_block_runs(block: Block, workdir: Path):
    done = subprocess.run(
        ["bash", "-e", "-c", block.code],
        cwd=workdir,
        env=environment(workdir),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
    for check in check_for(SHELL_CHECKS, block):
        check(workdir, done.stdout)


# ----------------------------------------------------------------------------- toml blocks


def check_few_shot(exp) -> None:
    # digits' meta-training classes 0-4, every client holding all five
    assert exp.config.task.ways == 5 and exp.train.num_classes == 5
    for client in exp.clients:
        assert len(set(exp.train.labels[client.inner].tolist())) == 5
    assert type(exp.model).__name__ == "Conv4"
    assert tuple(exp.train.input_shape) == (1, 16, 16)  # image_size = 16


def check_mnist(exp) -> None:
    assert type(exp.model).__name__ == "CNN7"
    assert tuple(exp.train.input_shape) == (1, 28, 28)  # digits written as 28x28 MNIST


def check_omniglot(exp) -> None:
    # the stand-in: 2 alphabets of 4 characters, each rotated 3 more times
    assert exp.train.num_classes == 2 * 4 * 4


def check_libsvm(exp) -> None:
    assert type(exp.model).__name__ == "FeatureL2Logistic"
    assert tuple(exp.train.input_shape) == (123,)
    assert len(exp.train) == 270  # 10 % of 300 held out


#: Checks of a run config block's built experiment (by a text the block contains).
CONFIG_CHECKS: dict[str, Callable] = {
    'name = "few_shot"': check_few_shot,
    'name = "mnist"': check_mnist,
    'name = "omniglot"': check_omniglot,
    'name = "libsvm"': check_libsvm,
}


@pytest.mark.parametrize("block", params("toml"))
def test_toml_block_is_accepted(block: Block, workdir: Path, monkeypatch):
    data = tomllib.loads(block.code)
    if "superlink" in data:  # the flwr CLI's connection file
        flower = pytest.importorskip("flwr.cli.flower_config")
        (workdir / ".flwr").mkdir(exist_ok=True)
        (workdir / ".flwr" / "config.toml").write_text(block.code)
        monkeypatch.setenv("FLWR_HOME", str(workdir / ".flwr"))
        conn = flower.read_superlink_connection(None)
        assert (conn.name, conn.address, conn.insecure) == ("local", "127.0.0.1:9093", True)
        return
    import radbo
    from radbo.config import parse_config

    monkeypatch.chdir(workdir)  # the README's paths are relative to the working directory
    exp = radbo.build(parse_config(data))
    assert len(exp.clients) == exp.config.fleet.num_clients
    for check in check_for(CONFIG_CHECKS, block):
        check(exp)


# ------------------------------------------------------------------ the demo's printed numbers


#: the PyTorch CPU kernels (``torch.backends.cpu.get_cpu_capability()``) that printed the
#: README's demo block (an Intel Xeon, as the README says beside it)
README_DEMO_KERNELS = "AVX512"

#: the demo summary's lines that come from the ledger alone (counts, FLOPs, bytes, the
#: simulated clock), which no CPU's rounding changes
LEDGER_LINES = ("communication rounds:", "compute:")


@pytest.mark.float_sensitive
def test_readme_demo_numbers_equal_a_fresh_demo(tmp_path: Path):
    """The summary the README shows under "Quick start" is what `make demo` prints now: the
    same lines before the files written, character for character, with the kernels that
    printed it (README_DEMO_KERNELS). With other kernels float32 rounds differently and the
    losses and accuracies differ (the README says so, with an AVX2 CPU's figures): the ledger
    lines must still be equal character for character, and every line says the same thing."""
    from radbo.config import load_config
    from radbo.experiment import run
    from radbo.experiment.summary import summary_lines

    text = README.read_text()
    start = text.index("    final test accuracy:")
    shown = []
    for line in text[start:].splitlines():
        if not line.startswith("    "):
            break
        shown.append(line[4:])

    result = run(load_config(ROOT / "examples" / "demo.toml"), progress=False, save=False)

    # (save=False: no "results: ..." lines of files written)
    got = summary_lines(result)
    if torch.backends.cpu.get_cpu_capability() == README_DEMO_KERNELS:
        assert shown == got, "README's demo block differs from a fresh demo run"
        return
    assert len(shown) == len(got)
    for a, b in zip(shown, got, strict=True):
        if a.startswith(LEDGER_LINES):
            assert a == b
        assert re.sub(r"[\d.]+", "#", a) == re.sub(r"[\d.]+", "#", b), (a, b)
