"""A hypothesis battery of damaged and forged checkpoints (issue 28, item 8: checkpoints).

A real run of 3 rounds (a checkpoint after each: the newest after round 3, the previous after
round 2) is copied, and the copy is edited with structure-aware mutations: JSON fields of the
index and of the history set to hostile values or rows added, removed and renumbered (every
hash re-signed, or not, so that the checks of meaning are what must refuse them), tensors
swapped for others of another shape or dtype, holding NaN or Inf, removed or added, files
truncated, padded, grown to gigabytes (sparse), replaced by a FIFO, a folder or a link to a
device, temporary files of crashed saves left beside them. The copy is then resumed to 4
rounds, and one of three things must happen:

* the resume equals the uninterrupted 4-round run: every round record (metrics, evaluations,
  costs), the ledger, the totals, the final evaluation and the state, bitwise -- with or
  without a fallback to the previous checkpoint (:class:`~radbo.checkpoint.CheckpointWarning`);
* or it is refused with radbo's :class:`~radbo.checkpoint.CheckpointError`, one line;

and nothing else: any other exception, a different result, a case that runs longer than
:data:`CASE_SECONDS` or a process whose peak RSS passes :data:`RSS_LIMIT` fails the battery.

The mutations change what a checkpoint's meaning can reveal. Some edits cannot be revealed by
any check, because the checkpoint is the only record of the value: a finite weight changed to
another finite weight, an algorithm's training loss in a round record, the FLOP meter's cached
counts, the divergence guard's running losses, a client list or a round time changed to other
valid ones. Those are left out (a resume from them is a resume from what the file says).

The battery runs in a subprocess (``python -m tests.checkpoint.test_battery_checkpoints``) with an
address-space limit (:data:`ADDRESS_SPACE`): a case that tried to read a 30 GiB file whole
fails with MemoryError instead of taking the machine's memory; each case has a wall-clock
alarm; the process reports its peak RSS and slowest case. The default suite runs a few
derandomized examples; ``pytest -m slow`` runs many more, freshly random.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import time_limit, unclocked_rows

TINY = {
    "eval_every": 2,
    "checkpoint_every": 1,
    "fleet": {"num_clients": 3},
    "model": {"name": "mlp", "hidden": [16]},
}
DONE = 3  # rounds of the run whose checkpoints are damaged (eval_every 2: its last round
LONGER = 4  # was evaluated for being the last; the resume extends it: issue 28, item 7)
CASE_SECONDS = 60
RSS_LIMIT = 1 << 30
ADDRESS_SPACE = 6 << 30
HARNESS_READ = 64 << 20  # the largest file the harness itself reads
INDEXES = ("checkpoint.json", "checkpoint-prev.json")
ROOT = Path(__file__).resolve().parents[2]


# -- in the parent: the tests ----------------------------------------------------------------


def run_battery(examples: int, *, derandomize: bool, timeout: int) -> dict[str, Any]:
    """Run the battery in a subprocess with an address-space limit; its summary."""

    def limit() -> None:  # in the child, before it starts
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    args = [
        sys.executable,
        "-m",
        "tests.checkpoint.test_battery_checkpoints",
        "--examples",
        str(examples),
    ]
    if derandomize:
        args.append("--derandomize")
    proc = subprocess.run(
        args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=limit,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-12000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["max_rss_bytes"] < RSS_LIMIT, summary
    assert summary["slowest_case_s"] < CASE_SECONDS, summary
    assert summary["cases"] >= examples // 2, summary
    return summary


def test_checkpoint_battery_short() -> None:
    """A few derandomized cases (the default suite); every outcome is one of the three."""
    summary = run_battery(25, derandomize=True, timeout=900)
    assert set(summary["outcomes"]) <= {"resumed", "fell back", "refused"}, summary


@pytest.mark.slow
def test_checkpoint_battery_long() -> None:
    summary = run_battery(400, derandomize=False, timeout=7200)
    # a long run meets every outcome
    assert set(summary["outcomes"]) == {"resumed", "fell back", "refused"}, summary


# -- in the child: the cases ------------------------------------------------------------------


def config(rounds: int) -> Any:
    from radbo.config import parse_config

    return parse_config({**TINY, "rounds": rounds})


@dataclasses.dataclass
class Bench:
    base: Path  # a finished run of DONE rounds with its checkpoints
    reference: Any  # the RunResult of an uninterrupted run of LONGER rounds


def make_bench(root: Path) -> Bench:
    from radbo.experiment import run

    base = root / "base"
    run(config(DONE), progress=False, output_dir=base, save=False)
    reference = run(config(LONGER), progress=False, output_dir=root / "reference", save=False)
    return Bench(base=base, reference=reference)


def plain_rows(rows: list[dict[str, Any]]) -> str:
    return json.dumps(unclocked_rows(rows), sort_keys=True)


def assert_same_run(result: Any, reference: Any) -> None:
    from radbo.checkpoint import state_to_tensors

    assert plain_rows(result.rounds) == plain_rows(reference.rounds)
    assert json.dumps(result.ledger) == json.dumps(reference.ledger)
    assert result.totals == reference.totals
    assert result.final == reference.final
    ta, sa = state_to_tensors(result.state)
    tb, sb = state_to_tensors(reference.state)
    assert sa == sb and ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and bool((ta[key] == tb[key]).all()), key


def resign_index(index: Path, data: dict[str, Any]) -> None:
    from radbo.checkpoint import _index_digest

    data["index_sha256"] = _index_digest(data)
    index.write_text(json.dumps(data))


def small_file(path: Path | None) -> bool:
    """Whether ``path`` is a regular file the harness may read whole (an earlier edit may have
    grown it to gigabytes, or made it a FIFO: the harness leaves those to radbo)."""
    if path is None:
        return False
    try:
        return path.is_file() and path.stat().st_size <= HARNESS_READ
    except OSError:
        return False


def index_data(index: Path) -> dict[str, Any] | None:
    if not small_file(index):
        return None
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def named_file(folder: Path, index: str, kind: str) -> Path | None:
    data = index_data(folder / index)
    try:
        name = data["files"][kind]["file"]  # type: ignore[index]
    except (TypeError, KeyError):
        return None
    return folder / name if isinstance(name, str) and "/" not in name else None


def record_file(folder: Path, index: str, kind: str, sign: bool) -> None:
    """Record the file's true SHA-256 in the index (``sign``) and re-sign the index."""
    if not sign:
        return
    path = named_file(folder, index, kind)
    data = index_data(folder / index)
    if path is None or data is None or not small_file(path):
        return
    data["files"][kind]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    resign_index(folder / index, data)


# -- the mutations -------------------------------------------------------------------------------

_ABSENT = object()


def dig(data: Any, path: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """The container holding ``path``'s last step, and that step (list indices wrap)."""
    for step in path[:-1]:
        if isinstance(data, dict) and step in data:
            data = data[step]
        elif isinstance(data, list) and isinstance(step, int) and data:
            data = data[step % len(data)]
        else:
            return None
    last = path[-1]
    if isinstance(data, list) and isinstance(last, int):
        if not data:
            return None
        last %= len(data)
    elif not isinstance(data, dict):
        return None
    return data, last


@dataclasses.dataclass
class SetIndex:
    """Set (or delete, value ``_ABSENT``) a field of an index, then re-sign it."""

    index: str
    path: tuple[Any, ...]
    value: Any
    sign: bool = True

    def apply(self, folder: Path) -> None:
        data = index_data(folder / self.index)
        if data is None:
            return
        found = dig(data, self.path)
        if found is None:
            return
        where, key = found
        if self.value is _ABSENT:
            if isinstance(where, dict):
                where.pop(key, None)
            else:
                del where[key]
        else:
            where[key] = copy.deepcopy(self.value)
        if self.sign:
            resign_index(folder / self.index, data)
        else:
            (folder / self.index).write_text(json.dumps(data))


@dataclasses.dataclass
class EditHistory:
    """Edit the history file an index names, then record its hash (``sign``)."""

    index: str
    op: str
    row: int
    key: str = ""
    value: Any = None
    sign: bool = True

    def apply(self, folder: Path) -> None:
        path = named_file(folder, self.index, "history")
        if path is None or not small_file(path):
            return
        try:
            data = json.loads(path.read_text())
            rows, ledger = data["rows"], data["ledger"]
            i = self.row % len(rows)
            j = self.row % len(ledger)
            assert isinstance(rows[i], dict) and isinstance(ledger[j], dict)
        except (ValueError, TypeError, KeyError, ZeroDivisionError, AssertionError):
            return  # an earlier edit left no history to edit
        if self.op == "set row":
            rows[i][self.key] = copy.deepcopy(self.value)
        elif self.op == "set ledger":
            ledger[j][self.key] = copy.deepcopy(self.value)
        elif self.op == "delete row":
            del rows[i]
        elif self.op == "duplicate row":
            rows.insert(i, copy.deepcopy(rows[i]))
        elif self.op == "append row":
            rows.append({**copy.deepcopy(rows[-1]), "round": len(rows)})
        elif self.op == "renumber rows":
            for r, row in enumerate(rows):
                row["round"] = r + self.row
        elif self.op == "delete ledger row":
            del ledger[j]
        elif self.op == "duplicate ledger row":
            ledger.insert(j, copy.deepcopy(ledger[j]))
        elif self.op == "drop a key":
            data.pop(self.key, None)
        elif self.op == "replace":
            data = copy.deepcopy(self.value)
        path.write_text(json.dumps(data))
        record_file(folder, self.index, "history", self.sign)


@dataclasses.dataclass
class EditTensors:
    """Edit the tensor file an index names, then record its hash (``sign``)."""

    index: str
    op: str
    pick: int
    arg: Any = None
    sign: bool = True

    def apply(self, folder: Path) -> None:
        import torch
        from safetensors.torch import load_file, save_file

        path = named_file(folder, self.index, "tensors")
        if path is None or not small_file(path):
            return
        try:
            tensors = load_file(str(path))
        except Exception:  # an earlier edit damaged it: nothing to edit
            return
        if not tensors:
            return
        keys = sorted(tensors)
        key = keys[self.pick % len(keys)]
        t = tensors[key]
        if self.op == "reshape":
            shape = list(t.shape) or [1]
            shape[self.pick % len(shape)] += 1 + int(self.arg) % 3
            tensors[key] = torch.zeros(shape, dtype=t.dtype)
        elif self.op == "flatten" and t.dim() > 1:
            tensors[key] = t.reshape(-1).clone()
        elif self.op == "dtype":
            tensors[key] = t.to(self.arg)
        elif self.op == "non-finite":
            floats = [k for k in keys if tensors[k].is_floating_point() and tensors[k].numel()]
            if not floats:
                return
            key = floats[self.pick % len(floats)]
            tensors[key].view(-1)[self.pick % tensors[key].numel()] = self.arg
        elif self.op == "delete":
            del tensors[key]
        elif self.op == "add":
            tensors[f"{self.arg}extra"] = torch.zeros(2)
        elif self.op == "rename":
            tensors[f"{key}_renamed"] = tensors.pop(key)
        elif self.op == "untrain mask":
            masks = [k for k in keys if tensors[k].dtype == torch.bool]
            if masks:
                mask = tensors[masks[self.pick % len(masks)]]
                mask.view(-1)[: 1 + self.pick % mask.numel()] = False
        save_file(tensors, str(path))
        record_file(folder, self.index, "tensors", self.sign)


@dataclasses.dataclass
class EditFile:
    """Damage a file of a checkpoint as a file: cut, padded, grown, replaced."""

    index: str
    kind: str  # "index", "tensors" or "history"
    op: str
    size: int = 0
    sign: bool = False

    def apply(self, folder: Path) -> None:
        path = (
            folder / self.index
            if self.kind == "index"
            else named_file(folder, self.index, self.kind)
        )
        if path is None or not small_file(path):
            return
        if self.op == "truncate":
            data = path.read_bytes()
            path.write_bytes(data[: self.size % max(len(data), 1)])
        elif self.op == "append":
            with path.open("ab") as fh:
                fh.write(b"\0 {}"[: 1 + self.size % 4] * (1 + self.size % 64))
        elif self.op == "grow":
            os.truncate(path, (1 + self.size % 30) << 30)  # sparse: no disk used
        elif self.op == "fifo":
            path.unlink()
            os.mkfifo(path)
        elif self.op == "folder":
            path.unlink()
            path.mkdir()
        elif self.op == "delete":
            path.unlink()
        elif self.op == "device":
            path.unlink()
            path.symlink_to("/dev/zero")
        if self.kind != "index" and self.op in ("truncate", "append"):
            record_file(folder, self.index, self.kind, self.sign)


@dataclasses.dataclass
class Leftovers:
    """Temporary files of saves that crashed."""

    count: int

    def apply(self, folder: Path) -> None:
        names = [
            ".state-000004.safetensors.abc123.tmp",
            ".history-000003.json.x_y.tmp",
            ".checkpoint.json.q9.tmp",
            ".checkpoint-prev.json.zz.tmp",
        ]
        for name in names[: 1 + self.count % len(names)]:
            (folder / name).write_bytes(b"half a file")


def strategies() -> Any:
    import torch
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=6),
    )
    hostile = st.one_of(
        scalars,
        st.lists(scalars, max_size=3),
        st.dictionaries(st.text(max_size=4), scalars, max_size=2),
    )
    # what no number radbo computes can be: a finite change to a measured value is invisible
    not_a_finite_number = st.one_of(
        st.sampled_from([math.nan, math.inf, -math.inf]),
        st.none(),
        st.booleans(),
        st.text(max_size=4),
        st.lists(scalars, max_size=2),
        st.dictionaries(st.text(max_size=3), scalars, max_size=1),
    )
    not_an_int = hostile.filter(lambda v: type(v) is not int)
    index_name = st.sampled_from(INDEXES)
    sign = st.booleans()

    fields = st.one_of(
        st.tuples(
            st.just(("format",)),
            st.one_of(
                st.sampled_from(["radbo-checkpoint/1", "radbo-checkpoint/3", "", "pickle"]),
                hostile,
            ),
        ),
        st.tuples(st.just(("rounds_done",)), st.one_of(st.integers(-3, 2**64), hostile)),
        st.tuples(st.just(("clock_s",)), st.one_of(st.floats(), hostile)),
        st.tuples(st.just(("state_scalars", "round")), not_an_int),
        st.tuples(st.just(("state_scalars",)), hostile),
        st.tuples(
            st.just(("simulation", "flop_meter", "measurements")),
            st.one_of(st.integers(-5, 1), not_an_int),
        ),
        st.tuples(
            st.sampled_from(
                [
                    ("simulation", "divergence", "good_rounds"),
                    ("simulation", "divergence", "rollbacks"),
                    ("simulation", "divergence", "diverging"),
                ]
            ),
            hostile,
        ),
        st.tuples(st.just(("simulation", "divergence", "largest_norm")), hostile),
        st.tuples(
            st.tuples(
                st.just("simulation"),
                st.just("divergence"),
                st.sampled_from(["first", "smoothed", "lowest"]),
                st.sampled_from(["inner_loss", "outer_loss", "test_loss"]),
            ),
            not_a_finite_number,
        ),
        st.tuples(
            st.tuples(
                st.just("simulation"),
                st.just("coverage"),
                st.sampled_from(["x", "y"]),
                st.just("history"),
                st.integers(0, 3),
                st.sampled_from(
                    [
                        "round",
                        "min_coverage",
                        "min_coverage_so_far",
                        "histogram",
                        "untrained_fraction",
                        "never_trained_fraction",
                        "numel",
                    ]
                ),
            ),
            hostile,
        ),
        st.tuples(
            st.tuples(st.just("simulation"), st.just("coverage"), st.sampled_from(["x", "y"])).map(
                lambda p: (*p, "names")
            ),
            hostile,
        ),
        st.tuples(
            st.sampled_from(
                [
                    ("simulation", "coverage", "x"),
                    ("simulation", "coverage"),
                    ("simulation", "flop_meter"),
                    ("simulation", "divergence"),
                    ("simulation", "divergence_previous"),
                    ("files",),
                    ("config",),
                    ("rounds_done",),
                ]
            ),
            st.just(_ABSENT),
        ),
        st.tuples(st.just(("config", "seed")), hostile),
        st.tuples(st.just(("config", "rounds")), hostile),  # a key a resume may change
        st.tuples(st.just(("unknown_key",)), hostile),
        st.tuples(
            st.tuples(
                st.just("files"),
                st.sampled_from(["tensors", "history"]),
                st.sampled_from(["file", "sha256"]),
            ),
            st.one_of(
                st.sampled_from(
                    ["state-000009.safetensors", "../x", "", "history-000001.json", "0" * 64]
                ),
                hostile,
            ),
        ),
    )
    set_index = st.builds(
        lambda index, field, sign: SetIndex(index, field[0], field[1], sign),
        index_name,
        fields,
        st.booleans(),
    )

    engine_fields = st.sampled_from(
        ["round", "wall_time_s", "sim_clock_s", "rejected_updates", "dropped_clients"]
        + ["late_clients", "cost_flops", "cost_samples", "cost_bytes", "cost_comm_s"]
        + ["coverage_x_min", "untrained_fraction_y", "coverage_y_histogram"]
    )
    typed_fields = st.sampled_from(["clients", "unavailable", "rejected", "dropped", "late"])
    set_row = st.one_of(
        st.builds(
            lambda index, row, key, value, s: EditHistory(index, "set row", row, key, value, s),
            index_name,
            st.integers(0, 5),
            engine_fields,
            hostile,
            sign,
        ),
        st.builds(
            lambda index, row, key, value, s: EditHistory(index, "set row", row, key, value, s),
            index_name,
            st.integers(0, 5),
            st.sampled_from(["test_accuracy", "test_loss", "test_balanced_accuracy"]),
            not_a_finite_number,
            sign,
        ),
        st.builds(
            lambda index, row, key, value, s: EditHistory(index, "set row", row, key, value, s),
            index_name,
            st.integers(0, 5),
            typed_fields,
            st.one_of(
                st.none(),
                st.text(max_size=3),
                st.lists(st.one_of(st.text(max_size=2), st.integers(-3, -1)), min_size=1),
            ),
            sign,
        ),
    )
    ledger_fields = st.sampled_from(
        ["flops", "n_grad", "n_hvp", "samples", "bytes_down", "bytes_up", "compute_s"]
        + ["comm_s", "energy_compute_j", "energy_radio_j", "round"]
    )
    set_ledger = st.one_of(
        st.builds(
            lambda index, row, key, value, s: EditHistory(index, "set ledger", row, key, value, s),
            index_name,
            st.integers(0, 30),
            ledger_fields,
            hostile,
            sign,
        ),
        st.builds(
            lambda index, row, value, s: EditHistory(index, "set ledger", row, "client", value, s),
            index_name,
            st.integers(0, 30),
            st.one_of(st.integers(3, 2**40), st.integers(-5, -1), not_an_int),
            sign,
        ),
        st.builds(
            lambda index, row, key, value, s: EditHistory(index, "set ledger", row, key, value, s),
            index_name,
            st.integers(0, 30),
            st.sampled_from(["phase", "tier"]),
            hostile.filter(lambda v: not isinstance(v, str)),
            sign,
        ),
    )
    history_ops = st.builds(
        EditHistory,
        index_name,
        st.sampled_from(
            [
                "delete row",
                "duplicate row",
                "append row",
                "renumber rows",
                "delete ledger row",
                "duplicate ledger row",
            ]
        ),
        st.integers(0, 30),
        st.just(""),
        st.none(),
        sign,
    )
    history_whole = st.one_of(
        st.builds(
            lambda index, key, s: EditHistory(index, "drop a key", 0, key, None, s),
            index_name,
            st.sampled_from(["rows", "ledger"]),
            sign,
        ),
        st.builds(
            lambda index, value, s: EditHistory(index, "replace", 0, "", value, s),
            index_name,
            hostile,
            sign,
        ),
    )
    tensors = st.one_of(
        st.builds(
            EditTensors,
            index_name,
            st.sampled_from(["reshape", "flatten", "delete", "rename", "untrain mask"]),
            st.integers(0, 50),
            st.integers(0, 5),
            sign,
        ),
        st.builds(
            EditTensors,
            index_name,
            st.just("dtype"),
            st.integers(0, 50),
            st.sampled_from([torch.float64, torch.float16, torch.int64, torch.bool, torch.uint8]),
            sign,
        ),
        st.builds(
            EditTensors,
            index_name,
            st.just("non-finite"),
            st.integers(0, 5000),
            st.sampled_from([math.nan, math.inf, -math.inf]),
            sign,
        ),
        st.builds(
            EditTensors,
            index_name,
            st.just("add"),
            st.integers(0, 50),
            st.sampled_from(
                ["x/", "y/", "buffers/", "sim/", "sim/coverage/x/", "sim/divergence_previous/x/"]
            ),
            sign,
        ),
    )
    files = st.builds(
        EditFile,
        index_name,
        st.sampled_from(["index", "tensors", "history"]),
        st.sampled_from(["truncate", "append", "grow", "fifo", "folder", "delete", "device"]),
        st.integers(0, 10**6),
        sign,
    )
    edit = st.one_of(
        set_index, set_row, set_ledger, history_ops, history_whole, tensors, files
    ) | st.builds(Leftovers, st.integers(0, 3))
    return st.lists(edit, min_size=1, max_size=3)


def check_case(bench: Bench, edits: list[Any], stats: dict[str, Any]) -> None:
    from hypothesis import event

    from radbo.checkpoint import CheckpointError, CheckpointWarning
    from radbo.experiment import run

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cut"
        shutil.copytree(bench.base, out)
        folder = out / "checkpoints" / "run"
        for edit in edits:
            edit.apply(folder)
        # with no index left at all (both deleted) the resume is refused before it touches
        # the folder; anything in an index's place is read, and refused as damaged
        indexed = any(os.path.lexists(folder / name) for name in INDEXES)
        start = time.monotonic()
        with time_limit(CASE_SECONDS), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = run(
                    config(LONGER), progress=False, output_dir=out, save=False, resume=True
                )
            except CheckpointError as err:
                assert "\n" not in str(err), str(err)
                outcome = "refused"
            else:
                assert_same_run(result, bench.reference)
                fell_back = any(issubclass(w.category, CheckpointWarning) for w in caught)
                assert fell_back == (result.resumed_from_fallback is not None)
                outcome = "fell back" if fell_back else "resumed"
        elapsed = time.monotonic() - start
        if indexed:
            left = [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
            assert not left, left  # removed at the start of the resume
        else:
            assert outcome == "refused", outcome  # nothing to resume: nothing started afresh
    event(outcome)
    stats["outcomes"][outcome] = stats["outcomes"].get(outcome, 0) + 1
    stats["cases"] += 1
    stats["slowest_case_s"] = max(stats["slowest_case_s"], elapsed)


def battery(examples: int, derandomize: bool) -> dict[str, Any]:
    import torch
    from hypothesis import HealthCheck, given, settings

    torch.set_num_threads(1)
    stats: dict[str, Any] = {"cases": 0, "outcomes": {}, "slowest_case_s": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        bench = make_bench(Path(tmp))

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=derandomize,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        )
        @given(edits=strategies())
        def case(edits: list[Any]) -> None:
            check_case(bench, edits, stats)

        case()
    stats["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=25)
    parser.add_argument("--derandomize", action="store_true")
    args = parser.parse_args(argv)
    stats = battery(args.examples, args.derandomize)
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
