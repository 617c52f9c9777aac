"""Checkpoints that prove their integrity (issue 15, item 3).

The index records the SHA-256 of the tensor file and of its own text and is validated by a
pydantic model; a damaged, malformed or non-finite checkpoint is refused with one line naming
the file, and a resume falls back to the previous checkpoint when that one verifies, saying so.
"""

import dataclasses
import hashlib
import json
import struct
import typing
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import radbo.checkpoint as checkpoint
from radbo.algorithms.rabo import RABOState
from radbo.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    save_checkpoint,
    state_to_tensors,
)
from radbo.cli import main
from radbo.config import parse_config
from radbo.cost import LedgerEntry, LedgerRow
from radbo.experiment import run
from radbo.masks import RoundCoverage
from radbo.masks.coverage_report import CoverageRow
from radbo.simulation import RUN_CHECKPOINT
from tests.checkpoint import test_checkpoint

# -- unit level: a small state saved and loaded directly -----------------------------------

# test_checkpoint's round record with a metric and an evaluation
ROW = {**test_checkpoint.ROW, "outer_loss": 0.5, "test_accuracy": 0.75}
LEDGER_ROW = {
    "round": 0,
    "phase": "train.inner",
    "client": 0,
    "tier": "laptop",
    "flops": 100,
    "n_grad": 1,
    "n_hvp": 0,
    "samples": 32,
    "bytes_down": 10,
    "bytes_up": 10,
    "compute_s": 0.001,
    "comm_s": 0.002,
}


def state(k: int) -> RABOState:
    return RABOState(
        x={"w": torch.full((2, 3), float(k))},
        y={"b": torch.full((2,), float(k), dtype=torch.float64)},
        buffers={"n": torch.tensor(k)},
        round=k,
    )


def save(folder, k: int):
    return save_checkpoint(
        folder,
        contents=RUN_CHECKPOINT,
        config={"seed": 0},
        state=state(k),
        rounds_done=k,
        clock_s=1.5 * k,
        # the clock after round r is 1.5 (r + 1): the loader checks clock_s against the rows
        rows=[{**ROW, "round": r, "sim_clock_s": 1.5 * (r + 1)} for r in range(k)],
        ledger=[{**LEDGER_ROW, "round": r} for r in range(k)],
        sim_tensors={"coverage/x/w": torch.tensor([True, False])},
        sim_meta={"coverage": {}, "flop_meter": None},
    )


def load(folder, **kw):
    return load_checkpoint(folder, template=state(0), contents=RUN_CHECKPOINT, **kw)


def same_state(a, b) -> bool:
    ta, sa = state_to_tensors(a)
    tb, sb = state_to_tensors(b)
    return sa == sb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def flip_bit(path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


def header_length(path) -> int:
    """safetensors layout: 8-byte little-endian header length, JSON header, data section."""
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def rewrite_index(path, tamper, *, resign: bool = True) -> None:
    """Apply ``tamper`` to the index at ``path``; with ``resign`` the index's own checksum is
    recomputed, as a writer that is wrong (not a damaged disk) would leave it."""
    data = json.loads(path.read_text())
    tamper(data)
    if resign:
        data["index_sha256"] = checkpoint._index_digest(data)
    path.write_text(json.dumps(data))


def rewrite_history(folder, tamper) -> None:
    """Apply ``tamper`` to the history file of the index in ``folder`` and record its true
    SHA-256 (re-signing the index), so only the history's model can refuse it."""
    index = folder / "checkpoint.json"
    path = folder / json.loads(index.read_text())["files"]["history"]["file"]
    data = json.loads(path.read_text())
    tamper(data)
    path.write_text(json.dumps(data))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    rewrite_index(index, lambda d: d["files"]["history"].update(sha256=digest))


def test_index_records_the_sha256_of_its_file_and_of_itself(tmp_path):
    index_path = save(tmp_path, 1)
    data = json.loads(index_path.read_text())
    assert data["format"] == "radbo-checkpoint/2"
    assert data["files"] == {
        kind: {"file": name, "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
        for kind, name in (
            ("tensors", "state-000001.safetensors"),
            ("history", "history-000001.json"),
        )
    }
    history = json.loads((tmp_path / "history-000001.json").read_text())
    assert history == {"rows": [ROW], "ledger": [LEDGER_ROW]}
    body = {k: v for k, v in data.items() if k != "index_sha256"}
    assert data["index_sha256"] == hashlib.sha256(json.dumps(body).encode()).hexdigest()
    assert RUN_CHECKPOINT.index_model.model_validate(data).rounds_done == 1
    assert same_state(load(tmp_path).state, state(1))


def test_row_models_have_the_fields_of_the_rows_they_check():
    """checkpoint.py sits below radbo.cost and radbo.masks, so it spells their rows out."""
    for model, cls in ((LedgerRow, LedgerEntry), (CoverageRow, RoundCoverage)):
        fields = typing.get_type_hints(model, include_extras=True)
        assert list(fields) == [f.name for f in dataclasses.fields(cls)]
        hints = typing.get_type_hints(cls)
        assert {name: plain(hint) for name, hint in fields.items()} == hints


def plain(hint):
    """``hint`` without Annotated metadata and NotRequired (list items included)."""
    if typing.get_origin(hint) is typing.NotRequired:
        return plain(typing.get_args(hint)[0])
    if typing.get_origin(hint) is list:
        return list[plain(typing.get_args(hint)[0])]
    if typing.get_origin(hint) is typing.Annotated:
        return typing.get_args(hint)[0]
    return hint


def test_flipped_bit_in_the_data_section_is_refused_naming_the_file(tmp_path):
    save(tmp_path, 1)
    tensors = tmp_path / "state-000001.safetensors"
    flip_bit(tensors, 8 + header_length(tensors) + 5)  # a byte of x/w's data
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    assert str(err.value) == (
        f"{tensors} does not match the SHA-256 its index records: the file is damaged"
    )


def test_flipped_bit_in_the_safetensors_header_is_refused(tmp_path):
    save(tmp_path, 1)
    tensors = tmp_path / "state-000001.safetensors"
    header = tensors.read_bytes()[8 : 8 + header_length(tensors)]
    flip_bit(tensors, 8 + header.index(b"[2,3]") + 1, bit=1)  # the shape [2,3] -> [0,3]
    with pytest.raises(CheckpointCorruptError, match="does not match the SHA-256") as err:
        load(tmp_path)
    assert str(tensors) in str(err.value)


def test_damaged_newest_falls_back_to_the_previous_and_says_so(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    newest = tmp_path / "state-000002.safetensors"
    flip_bit(newest, 8 + header_length(newest) + 3, bit=6)
    reason = f"{newest} does not match the SHA-256 its index records: the file is damaged"
    with pytest.warns(CheckpointWarning) as caught:
        ckpt = load(tmp_path)
    assert str(caught[0].message) == (
        f"{reason}; resuming from the previous checkpoint "
        f"({tmp_path / 'checkpoint-prev.json'}, after round 1) instead"
    )
    assert ckpt.fallback == reason and ckpt.rounds_done == 1 and ckpt.clock_s == 1.5
    assert same_state(ckpt.state, state(1)) and len(ckpt.rows) == len(ckpt.ledger) == 1


def test_missing_newest_index_falls_back_to_the_previous(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "checkpoint.json").unlink()
    with pytest.warns(CheckpointWarning, match="checkpoint.json is missing; resuming from"):
        assert load(tmp_path).rounds_done == 1


@pytest.mark.parametrize("kind", ["pipe", "folder", "device"])
def test_something_else_in_place_of_both_indexes_is_refused_as_such(tmp_path, kind):
    """Not "no checkpoint": a resume would then call the folder empty (CI, stop 49: the
    long checkpoint battery met two pipes), so both are read and refused, naming each."""
    import os

    save(tmp_path, 1)
    save(tmp_path, 2)
    for name in ("checkpoint.json", "checkpoint-prev.json"):
        path = tmp_path / name
        path.unlink()
        if kind == "pipe":
            os.mkfifo(path)
        elif kind == "folder":
            path.mkdir()
        else:
            path.symlink_to("/dev/zero")
    assert checkpoint.has_checkpoint(tmp_path)
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'checkpoint.json'} is not a regular file; the previous checkpoint is "
        f"refused too: {tmp_path / 'checkpoint-prev.json'} is not a regular file"
    )


def test_when_no_checkpoint_verifies_the_error_names_both(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    for k in (1, 2):
        tensors = tmp_path / f"state-00000{k}.safetensors"
        flip_bit(tensors, 8 + header_length(tensors))
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    damaged = "does not match the SHA-256 its index records: the file is damaged"
    assert str(err.value) == (
        f"{tmp_path / 'state-000002.safetensors'} {damaged}; the previous checkpoint is "
        f"refused too: {tmp_path / 'state-000001.safetensors'} {damaged}"
    )


def write_tensors_with_a_correct_hash(folder, k: int, change) -> None:
    """Rewrite checkpoint k's tensors through ``change`` and record their true SHA-256 (and
    re-sign the index), so only the finite check can refuse them."""
    path = folder / f"state-00000{k}.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    rewrite_index(folder / "checkpoint.json", lambda d: d["files"]["tensors"].update(sha256=digest))


@pytest.mark.parametrize(
    ("key", "value"), [("x/w", float("nan")), ("y/b", float("inf")), ("y/b", float("-inf"))]
)
def test_non_finite_state_is_refused(tmp_path, key, value):
    save(tmp_path, 1)
    write_tensors_with_a_correct_hash(tmp_path, 1, lambda t: t[key].view(-1)[1].fill_(value))
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'state-000001.safetensors'}: tensor {key!r} holds NaN or Inf"
    )


def test_nan_weights_in_the_newest_fall_back_to_the_previous(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    write_tensors_with_a_correct_hash(tmp_path, 2, lambda t: t["x/w"].fill_(float("nan")))
    with pytest.warns(CheckpointWarning, match=r"tensor 'x/w' holds NaN or Inf; resuming"):
        ckpt = load(tmp_path)
    assert same_state(ckpt.state, state(1))


MALFORMED = {
    "missing rounds_done": (lambda d: d.pop("rounds_done"), "rounds_done is missing"),
    "string rounds_done": (
        lambda d: d.update(rounds_done="2"),
        "rounds_done = '2': Input should be a valid integer",
    ),
    "bool rounds_done": (
        lambda d: d.update(rounds_done=True),
        "rounds_done = True: Input should be a valid integer",
    ),
    "negative rounds_done": (
        lambda d: d.update(rounds_done=-1),
        "rounds_done = -1: Input should be greater than or equal to 0",
    ),
    "string clock": (
        lambda d: d.update(clock_s="1.5"),
        "clock_s = '1.5': Input should be a valid number",
    ),
    "infinite clock": (
        lambda d: d.update(clock_s=float("inf")),
        "clock_s = inf: Input should be a finite number",
    ),
    "scalars not an object": (
        lambda d: d.update(state_scalars="round=1"),
        "state_scalars = 'round=1': Input should be a JSON object",
    ),
    "scalar that is a list": (
        lambda d: d["state_scalars"].update(round=[1]),
        "state_scalars: state scalar 'round' = [1] is not a number, string, true/false or null",
    ),
    "tensor file with a path": (
        lambda d: d["files"]["tensors"].update(file="../../etc/x.safetensors"),
        "files.tensors.file = '../../etc/x.safetensors': String should match pattern "
        "'^[A-Za-z0-9_][A-Za-z0-9_.-]*$'",
    ),
    "hash not 64 hex digits": (
        lambda d: d["files"]["history"].update(sha256="ABC"),
        "files.history.sha256 = 'ABC': String should match pattern '^[0-9a-f]{64}$'",
    ),
    "unknown top-level key": (lambda d: d.update(pickle="x"), "pickle is an unknown field"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_index_field_is_one_line(tmp_path, case):
    tamper, message = MALFORMED[case]
    index_path = save(tmp_path, 1)
    rewrite_index(index_path, tamper)
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    assert str(err.value) == f"{index_path} is a malformed checkpoint index: {message}"


HISTORY_MALFORMED = {
    "ledger row not an object": (
        lambda d: d["ledger"].__setitem__(0, 5),
        "ledger[0] = 5: Input should be a JSON object",
    ),
    "ledger row with a string count": (
        lambda d: d["ledger"][0].update(flops="many"),
        "ledger[0].flops = 'many': Input should be a valid integer",
    ),
    "ledger row without a phase": (
        lambda d: d["ledger"][0].pop("phase"),
        "ledger[0].phase is missing",
    ),
    "ledger row with an unknown key": (
        lambda d: d["ledger"][0].update(extra=1),
        "ledger[0].extra is an unknown field",
    ),
    "ledger not a list": (
        lambda d: d.update(ledger="none"),
        "ledger = 'none': Input should be a valid list",
    ),
    "row with clients not a list": (
        lambda d: d["rows"][0].update(clients="all"),
        "rows[0].clients = 'all': Input should be a valid list",
    ),
    "row with a text accuracy": (
        lambda d: d["rows"][0].update(test_accuracy="good"),
        "rows[0]: test_accuracy = 'good' is not a number",
    ),
}


@pytest.mark.parametrize("case", sorted(HISTORY_MALFORMED))
def test_malformed_history_is_one_line(tmp_path, case):
    tamper, message = HISTORY_MALFORMED[case]
    save(tmp_path, 1)
    rewrite_history(tmp_path, tamper)
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    path = tmp_path / "history-000001.json"
    assert str(err.value) == f"{path} is a malformed checkpoint history: {message}"


def test_damaged_history_is_refused_naming_the_file(tmp_path):
    save(tmp_path, 1)
    history = tmp_path / "history-000001.json"
    history.write_text(history.read_text().replace('"flops": 100', '"flops": 900'))
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    assert str(err.value) == (
        f"{history} does not match the SHA-256 its index records: the file is damaged"
    )


def test_scalar_of_the_wrong_type_is_refused(tmp_path):
    index_path = save(tmp_path, 1)
    rewrite_index(index_path, lambda d: d["state_scalars"].update(round="two"))
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    assert str(err.value) == (
        "state field 'round' is 'two' in the checkpoint, not of this run's type (int)"
    )


def test_an_edited_index_fails_its_own_checksum(tmp_path):
    """A changed round count or row is caught even though it is well-formed."""
    index_path = save(tmp_path, 2)
    rewrite_index(index_path, lambda d: d.update(rounds_done=1), resign=False)
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    assert str(err.value) == (
        f"{index_path} does not match its index_sha256: the index was changed or damaged "
        "after it was written"
    )


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"format": ', "Expecting value: line 1 column 12 (char 11)"),
    ],
)
def test_unreadable_index_is_one_line(tmp_path, text, detail):
    (tmp_path / "checkpoint.json").write_text(text)
    with pytest.raises(CheckpointCorruptError) as err:
        load(tmp_path)
    assert str(err.value) == (
        f"{tmp_path / 'checkpoint.json'} is not a readable checkpoint index: {detail}"
    )


def test_checkpoints_from_before_checksums_are_refused(tmp_path):
    index_path = save(tmp_path, 1)
    rewrite_index(index_path, lambda d: d.update(format="radbo-checkpoint/1"))
    with pytest.raises(CheckpointError) as err:
        load(tmp_path)
    assert not isinstance(err.value, CheckpointCorruptError)  # nothing to fall back to
    assert str(err.value) == (
        f"{index_path} is a radbo-checkpoint/1 checkpoint, written before checkpoints carried "
        f"checksums, so it cannot be verified; start the run afresh (delete {tmp_path} or use "
        "another output_dir)"
    )


def test_a_different_config_is_refused_without_fallback(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match=r"different config \(seed: 0 then, 1 now\)"):
            load(tmp_path, config={"seed": 1})


def test_only_a_verified_earlier_checkpoint_becomes_the_previous(tmp_path):
    save(tmp_path, 1)
    first = tmp_path / "state-000001.safetensors"
    flip_bit(first, 8 + header_length(first))
    save(tmp_path, 2)  # the damaged checkpoint 1 is not kept as the fallback
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.json",
        "history-000002.json",
        "state-000002.safetensors",
    ]
    save(tmp_path, 3)
    save(tmp_path, 3)  # the same round again: its files are replaced, the fallback stays 2
    prev = json.loads((tmp_path / "checkpoint-prev.json").read_text())
    assert prev["rounds_done"] == 2
    assert sorted(p.name for p in tmp_path.glob("*-00000*")) == [
        "history-000002.json",
        "history-000003.json",
        "state-000002.safetensors",
        "state-000003.safetensors",
    ]


def test_a_crash_before_the_commit_leaves_a_checkpoint_that_loads(tmp_path, monkeypatch):
    save(tmp_path, 1)
    save(tmp_path, 2)

    def crash(path, text):
        raise OSError("killed while writing the index")

    monkeypatch.setattr(checkpoint, "atomic_write_text", crash)
    with pytest.raises(OSError, match="killed"):
        save(tmp_path, 3)  # tensor file written and the current index copied, no new index
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt = load(tmp_path)
    assert ckpt.rounds_done == 2 and same_state(ckpt.state, state(2))
    assert json.loads((tmp_path / "checkpoint-prev.json").read_text())["rounds_done"] == 2


# -- through radbo.run and the command line ----------------------------------------------

TINY = {
    "eval_every": 1,
    "checkpoint_every": 1,
    "fleet": {"num_clients": 3},
    "model": {"name": "mlp", "hidden": [16]},
}


def results(folder) -> dict:
    data = json.loads((folder / "results.json").read_text())
    for row in data["rounds"]:
        row.pop("wall_time_s")
    data.pop("config")
    return data


def test_run_resumes_from_the_previous_checkpoint_after_a_flipped_data_bit(tmp_path):
    whole = run(parse_config({**TINY, "rounds": 3}), progress=False, output_dir=tmp_path / "a")
    run(parse_config({**TINY, "rounds": 2}), progress=False, output_dir=tmp_path / "b")
    newest = tmp_path / "b/checkpoints/run/state-000002.safetensors"
    flip_bit(newest, 8 + header_length(newest) + 11, bit=3)

    with pytest.warns(CheckpointWarning, match="resuming from the previous checkpoint"):
        resumed = run(
            parse_config({**TINY, "rounds": 3}),
            progress=False,
            output_dir=tmp_path / "b",
            resume=True,
        )
    reason = f"{newest} does not match the SHA-256 its index records: the file is damaged"
    assert resumed.resumed_from_fallback == reason
    saved = results(tmp_path / "b")
    assert saved.pop("resumed_from_fallback") == reason
    assert saved == results(tmp_path / "a")  # round 1 ran again, to the same numbers
    assert same_state(whole.state, resumed.state)


def test_cli_refuses_a_damaged_checkpoint_with_one_line_and_exit_code_2(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        'rounds = 2\neval_every = 1\n[fleet]\nnum_clients = 3\n[model]\nname = "mlp"\n'
        "hidden = [16]\n"
    )
    out = tmp_path / "out"
    args = ["run", str(config), "--quiet", "--output-dir", str(out), "--checkpoint-every", "2"]
    assert main(args) == 0  # one checkpoint, after round 2: nothing to fall back to
    folder = out / "checkpoints/run"
    index, tensors = folder / "checkpoint.json", folder / "state-000002.safetensors"
    good = {p: p.read_bytes() for p in (index, tensors)}

    def flip_data_bit():
        flip_bit(tensors, 8 + header_length(tensors) + 2)

    def nan_weights():
        loaded = load_file(str(tensors))
        next(t for t in loaded.values() if t.is_floating_point()).view(-1)[0] = float("nan")
        save_file(loaded, str(tensors))
        digest = hashlib.sha256(tensors.read_bytes()).hexdigest()
        rewrite_index(index, lambda d: d["files"]["tensors"].update(sha256=digest))

    cases = [
        (flip_data_bit, f"{tensors} does not match the SHA-256 its index records"),
        (lambda: rewrite_index(index, lambda d: d.pop("rounds_done")), "rounds_done is missing"),
        (
            lambda: rewrite_history(folder, lambda d: d["ledger"][0].update(client="0")),
            "ledger[0].client = '0': Input should be a valid integer",
        ),
        (nan_weights, "holds NaN or Inf"),
    ]
    capsys.readouterr()
    for damage, message in cases:
        for path, content in good.items():
            path.write_bytes(content)
        damage()
        assert main([*args, "--resume", "--rounds", "3"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err and "Traceback" not in err
