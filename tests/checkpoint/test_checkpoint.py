"""Checkpoints (safetensors + JSON, atomic) and resume: a resumed run equals an uninterrupted one."""

import json

import pytest
import torch

import radbo.checkpoint as checkpoint
from radbo.algorithms.rabo import RABOState
from radbo.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    state_from_tensors,
    state_to_tensors,
)
from radbo.cli import main
from radbo.experiment import run
from radbo.simulation import RUN_CHECKPOINT, Simulation
from tests.configs import small_config
from tests.helpers import assert_same_state, comparable_results


class Crash(Exception):
    pass


def crash_at(monkeypatch, round_index: int, *, skip: int = 0) -> None:
    """Make Simulation.step raise when it reaches ``round_index``, after letting the first
    ``skip`` visits of that round through (a run and its baseline both visit every round)."""
    real_step = Simulation.step
    seen = [0]

    def step(self, state, round, clock_s=0.0):
        if round == round_index:
            seen[0] += 1
            if seen[0] == skip + 1:
                raise Crash(f"killed before round {round}")
        return real_step(self, state, round, clock_s)

    monkeypatch.setattr(Simulation, "step", step)


def comparable(out) -> tuple[str, str]:
    """results.json as sorted JSON text (so NaN metrics compare equal) and ledger.json."""
    results = json.dumps(comparable_results(out), sort_keys=True)
    return results, (out / "ledger.json").read_text()


CASES = {
    "rabo-coverage": dict(
        fleet={"capacities": [1.0, 0.5, 0.25]}, mask={"policy": "coverage", "coverage_k": 2}
    ),
    "rafbo": dict(
        algorithm={"name": "rafbo"},
        estimator={"name": "finite_difference", "num_coordinates": 4},
        fleet={"capacities": [1.0, 0.5]},
    ),
    "shrofbo-uniform-tau": dict(
        algorithm={"name": "shrofbo"},
        fleet={
            "capacities": [1.0, 0.5],
            "local_steps": "uniform_per_round",
            "local_steps_range": [1, 4],
        },
    ),
    "first-order": dict(estimator={"name": "first_order", "inner_steps": 3}),
    "fedmbo-dropout": dict(
        algorithm={"name": "fedmbo", "inner_steps": 2, "neumann_terms": 3, "clients_per_phase": 4},
        mask={"policy": "none"},
        fleet={"capacities": [1.0], "dropout": 0.2},
    ),
    "fedmsa": dict(
        algorithm={"name": "fedmsa", "local_steps": 2},
        mask={"policy": "none"},
        fleet={"capacities": [1.0]},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resumed_run_equals_uninterrupted(tmp_path, monkeypatch, case):
    # the baseline's checkpoints are test_crash_in_the_baseline_resumes_both_runs's subject
    cfg = small_config(rounds=4, checkpoint_every=2, baseline={"enabled": False}, **CASES[case])
    whole = run(cfg, progress=False, output_dir=tmp_path / "whole")

    crash_at(monkeypatch, 3)  # the checkpoint after round 2 is the last one written
    with pytest.raises(Crash):
        run(cfg, progress=False, output_dir=tmp_path / "cut")
    folder = tmp_path / "cut/checkpoints/run"
    index = json.loads((folder / "checkpoint.json").read_text())
    history = json.loads((folder / index["files"]["history"]["file"]).read_text())
    assert index["rounds_done"] == 2 and len(history["rows"]) == 2
    resumed = run(cfg, progress=False, output_dir=tmp_path / "cut", resume=True)

    assert comparable(tmp_path / "whole") == comparable(tmp_path / "cut")
    assert_same_state(whole.state, resumed.state)
    assert whole.totals == resumed.totals


def test_crash_in_the_baseline_resumes_both_runs(tmp_path, monkeypatch):
    cfg = small_config(rounds=3, checkpoint_every=2, baseline={"enabled": True})
    run(cfg, progress=False, output_dir=tmp_path / "whole")
    crash_at(monkeypatch, 2, skip=1)  # the main run passes round 2, the baseline dies there
    with pytest.raises(Crash):
        run(cfg, progress=False, output_dir=tmp_path / "cut")
    done = json.loads((tmp_path / "cut/checkpoints/run/checkpoint.json").read_text())
    base = json.loads((tmp_path / "cut/checkpoints/baseline/checkpoint.json").read_text())
    assert (done["rounds_done"], base["rounds_done"]) == (3, 2)
    assert not (tmp_path / "cut/results.json").exists()

    run(cfg, progress=False, output_dir=tmp_path / "cut", resume=True)
    assert comparable(tmp_path / "whole") == comparable(tmp_path / "cut")


@pytest.mark.parametrize(("short", "longer"), [(2, 3), (3, 5)])
def test_extending_a_finished_run_equals_running_longer(tmp_path, short, longer):
    """The run and its baseline both continue from their last checkpoints; every round record
    (metrics, evaluations, costs), the totals, the ledger and the state equal those of a run
    made at the longer length at once. With eval_every = 2, a run of 2 rounds ends on a
    regular evaluation, which stays; a run of 3 evaluated its last round only for being the
    last (issue 28, item 7): extended, that evaluation goes, from the record and from the
    divergence guard's running test loss."""
    long = run(
        small_config(rounds=longer, checkpoint_every=2),
        progress=False,
        output_dir=tmp_path / "a",
    )
    first = run(
        small_config(rounds=short, checkpoint_every=2), progress=False, output_dir=tmp_path / "b"
    )
    assert any(k.startswith("test_") for k in first.rounds[-1])  # the last round is evaluated
    extended = run(
        small_config(rounds=longer, checkpoint_every=2),
        progress=False,
        output_dir=tmp_path / "b",
        resume=True,
    )
    assert comparable(tmp_path / "a") == comparable(tmp_path / "b")
    for whole, resumed in ((long, extended), (long.baseline, extended.baseline)):
        assert whole is not None and resumed is not None
        strip = [{k: v for k, v in r.items() if k != "wall_time_s"} for r in whole.rounds]
        assert strip == [{k: v for k, v in r.items() if k != "wall_time_s"} for r in resumed.rounds]
        assert whole.totals == resumed.totals and whole.final == resumed.final
        assert_same_state(whole.state, resumed.state)
    evaluated = [r["round"] for r in extended.rounds if "test_accuracy" in r]
    assert evaluated == [q for q in range(longer) if (q + 1) % 2 == 0 or q == longer - 1]
    # the engine's state in the last checkpoint is the longer run's too (the guard's values)
    index = [
        json.loads((tmp_path / d / "checkpoints/run/checkpoint.json").read_text()) for d in "ab"
    ]
    assert index[0]["simulation"] == index[1]["simulation"]


def test_a_run_finished_without_checkpoints_continues_from_its_final_state(tmp_path):
    """Without checkpoint_every a run writes only checkpoints/final (what radbo export reads);
    --resume continues from it: extended to more rounds it equals the longer run made at once
    (its baseline, which has no checkpoint, runs again from round 0: the same numbers), and
    resumed at its own length it is the same run. This is what lets `radbo run --seeds ...
    --resume` pass over the seeds an interrupted command had finished."""
    long = run(small_config(rounds=3), progress=False, output_dir=tmp_path / "a")
    run(small_config(rounds=2), progress=False, output_dir=tmp_path / "b")
    assert not (tmp_path / "b/checkpoints/run").exists()

    extended = run(small_config(rounds=3), progress=False, output_dir=tmp_path / "b", resume=True)
    again = run(small_config(rounds=3), progress=False, output_dir=tmp_path / "b", resume=True)

    assert comparable(tmp_path / "a") == comparable(tmp_path / "b")
    for resumed in (extended, again):
        strip = [{k: v for k, v in r.items() if k != "wall_time_s"} for r in long.rounds]
        assert strip == [{k: v for k, v in r.items() if k != "wall_time_s"} for r in resumed.rounds]
        assert long.totals == resumed.totals and long.final == resumed.final
        assert_same_state(long.state, resumed.state)


def test_resume_without_checkpoint_is_refused_not_started_afresh(tmp_path):
    """Issue 27: a resume with nothing to resume is an error that says how to start afresh,
    raised before anything is built or written (it used to start from round 0 silently)."""
    cfg = small_config(rounds=2, baseline={"enabled": False})
    with pytest.raises(CheckpointError, match="nothing to resume in .*run without --resume"):
        run(cfg, progress=False, output_dir=tmp_path / "a", resume=True)
    assert not (tmp_path / "a").exists()


def test_other_config_or_fewer_rounds_is_refused(tmp_path):
    off = {"enabled": False}
    run(
        small_config(rounds=2, checkpoint_every=1, baseline=off),
        progress=False,
        output_dir=tmp_path,
    )
    with pytest.raises(CheckpointError, match=r"different config \(seed: 0 then, 1 now\)"):
        run(
            small_config(rounds=2, seed=1, baseline=off),
            progress=False,
            output_dir=tmp_path,
            resume=True,
        )
    with pytest.raises(CheckpointError, match="after round 2, past rounds = 1"):
        run(small_config(rounds=1, baseline=off), progress=False, output_dir=tmp_path, resume=True)


def test_cli_resume_and_bad_checkpoint_exit_codes(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        'rounds = 2\neval_every = 1\n[fleet]\nnum_clients = 3\n[model]\nname = "mlp"\nhidden = [16]\n'
    )
    out = tmp_path / "out"
    args = ["run", str(config), "--quiet", "--output-dir", str(out), "--checkpoint-every", "1"]
    assert main(args) == 0
    assert main([*args, "--resume", "--rounds", "3"]) == 0
    assert json.loads((out / "checkpoints/run/checkpoint.json").read_text())["rounds_done"] == 3
    capsys.readouterr()
    assert main([*args, "--resume", "--seed", "5"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "different config (seed: 0 then, 5 now)" in err


# -- the format ---------------------------------------------------------------------------


def small_state(round_=0):
    return RABOState(
        x={"w": torch.arange(6.0).reshape(2, 3)[:, 1:]},  # a strided view is stored compactly
        y={"b": torch.ones(2, dtype=torch.float64)},
        buffers={"n": torch.tensor(4)},
        round=round_,
        aux={},
    )


# a round record as the engine writes it (RoundRecord.as_dict); the index model checks its types
ROW = {
    "round": 0,
    "clients": [0, 1],
    "unavailable": [],
    "rejected": {},
    "dropped": {},
    "late": {},
    "communication_rounds": 2,
    "wall_time_s": 0.1,
    "sim_round_time_s": 1.5,
    "sim_clock_s": 1.5,
}


def save(tmp_path, state, rounds_done=1):
    return save_checkpoint(
        tmp_path,
        contents=RUN_CHECKPOINT,
        config={"seed": 0},
        state=state,
        rounds_done=rounds_done,
        clock_s=1.5,
        # a NaN metric: nothing measured (no client result reached that phase)
        rows=[{**ROW, "round": r, "loss": float("nan")} for r in range(rounds_done)],
        ledger=[],
        sim_tensors={"coverage/x/w": torch.tensor([True, False])},
        sim_meta={"coverage": {}},
    )


def test_round_trip_and_old_tensor_files_removed(tmp_path):
    save(tmp_path, small_state(1), rounds_done=1)
    save(tmp_path, small_state(2), rounds_done=2)
    save(tmp_path, small_state(3), rounds_done=3)
    # the newest checkpoint and the one before it (the fallback) are kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-prev.json",
        "checkpoint.json",
        "history-000002.json",
        "history-000003.json",
        "state-000002.safetensors",
        "state-000003.safetensors",
    ]
    ckpt = load_checkpoint(
        tmp_path, template=small_state(), config={"seed": 0}, contents=RUN_CHECKPOINT
    )
    assert_same_state(ckpt.state, small_state(3))
    assert ckpt.rounds_done == 3 and ckpt.clock_s == 1.5 and ckpt.fallback is None
    assert torch.equal(ckpt.sim_tensors["coverage/x/w"], torch.tensor([True, False]))
    assert ckpt.rows[0]["loss"] != ckpt.rows[0]["loss"]  # NaN survives JSON


def test_the_records_mean_what_the_contents_say(tmp_path):
    """radbo.checkpoint stores and verifies files; what the records mean comes from the
    caller's Contents. Records no run writes pass with PLAIN (any JSON objects, no meaning
    checked) and are refused with a run's contents; a damaged file is refused with either."""
    save_checkpoint(
        tmp_path,
        config={"seed": 0},
        state=small_state(1),
        rounds_done=4,  # no run: four rounds done without a round record
        clock_s=-2.0,
        rows=[{"anything": [1, 2]}],
        ledger=[{"cost": "free"}],
        sim_tensors={},
        sim_meta={"mine": 1},
        contents=checkpoint.PLAIN,
    )
    ckpt = load_checkpoint(tmp_path, template=small_state(), contents=checkpoint.PLAIN)
    assert (ckpt.rounds_done, ckpt.rows, ckpt.ledger, ckpt.sim_meta) == (
        4,
        [{"anything": [1, 2]}],
        [{"cost": "free"}],
        {"mine": 1},
    )
    with pytest.raises(checkpoint.CheckpointCorruptError, match=r"rows\[0\]\.round is missing"):
        load_checkpoint(tmp_path, template=small_state(), contents=RUN_CHECKPOINT)
    history = next(tmp_path.glob("history-*.json"))
    history.write_bytes(history.read_bytes().replace(b"free", b"paid"))
    with pytest.raises(checkpoint.CheckpointCorruptError, match="SHA-256|sha256|damaged"):
        load_checkpoint(tmp_path, template=small_state(), contents=checkpoint.PLAIN)


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save(tmp_path, small_state(1), rounds_done=1)

    def broken(tensors, path):
        open(path, "wb").write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path, small_state(2), rounds_done=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint.json",
        "history-000001.json",
        "state-000001.safetensors",
    ]
    assert (
        load_checkpoint(tmp_path, template=small_state(), contents=RUN_CHECKPOINT).state.round == 1
    )


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (
            lambda d: d["files"]["tensors"].update(file="../elsewhere.safetensors"),
            r"files.tensors.file = '../elsewhere.safetensors': String should match pattern",
        ),
        (lambda d: d["files"]["tensors"].update(file="state-000009.safetensors"), "is missing"),
        (lambda d: d.update(format="pickle"), "is not a radbo-checkpoint/2 index"),
        (lambda d: d["state_scalars"].pop("round"), "no value for state field 'round'"),
    ],
)
def test_damaged_index_is_a_clear_error(tmp_path, tamper, message):
    index_path = save(tmp_path, small_state())
    data = json.loads(index_path.read_text())
    tamper(data)
    data["index_sha256"] = checkpoint._index_digest(data)  # past the index's own checksum
    index_path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path, template=small_state(), contents=RUN_CHECKPOINT)


def test_shapes_and_names_must_match_the_run(tmp_path):
    save(tmp_path, small_state())
    other = RABOState(
        x={"w": torch.zeros(2, 3)}, y={"b": torch.ones(2, dtype=torch.float64)}, buffers={}
    )
    with pytest.raises(
        CheckpointError,
        match=r"'x/w' is torch.float32 \(2, 2\), this run has torch.float32 \(2, 3\)",
    ):
        load_checkpoint(tmp_path, template=other, contents=RUN_CHECKPOINT)
    fewer = RABOState(
        x={"w": torch.zeros(2, 2)}, y={"b": torch.ones(2, dtype=torch.float64)}, buffers={}
    )
    with pytest.raises(CheckpointError, match=r"tensors this run does not: \['buffers/n'\]"):
        load_checkpoint(tmp_path, template=fewer, contents=RUN_CHECKPOINT)


def test_garbage_and_missing_index(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path, template=small_state(), contents=RUN_CHECKPOINT)
    (tmp_path / "checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a readable checkpoint index"):
        load_checkpoint(tmp_path, template=small_state(), contents=RUN_CHECKPOINT)


def test_only_tensors_and_scalars_are_checkpointable():
    from dataclasses import dataclass

    @dataclass
    class Odd:
        x: dict
        model: object

    with pytest.raises(TypeError, match="holds a Linear"):
        state_to_tensors(Odd({"a": torch.ones(1)}, torch.nn.Linear(1, 1)))
    with pytest.raises(TypeError, match=r"x\['a'\] is not a tensor"):
        state_to_tensors(Odd({"a": 1.0}, None))
    tensors, scalars = state_to_tensors(Odd({"a": torch.ones(1)}, None))
    assert state_from_tensors(Odd({"a": torch.zeros(1)}, 3), tensors, scalars).model is None


def test_atomic_files_get_the_usual_permissions(tmp_path):
    import os

    from radbo.atomic import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert list(tmp_path.iterdir()) == [tmp_path / "a.json"]  # no temporary file left
