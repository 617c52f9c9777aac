"""``radbo run`` / ``radbo fleet`` on the command line and the run folder (issue 27): a closed
pipe, --version, refused resumes and overwrites, several seeds with their confidence
interval, progress on a non-terminal stream, the τ a drawn local-steps schedule gives."""

import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats

import radbo.cli
from radbo.checkpoint import _config_differences
from radbo.cli import EXIT_PIPE, main
from radbo.config import RunConfig, parse_config
from radbo.experiment import RunResult, build, fleet_table
from radbo.experiment.progress import LineProgress, progress_bar
from radbo.experiment.seeds import aggregate_runs, aggregate_table
from radbo.version import __version__
from tests.helpers import comparable_results

TINY = (
    'rounds = 1\neval_every = 1\n[fleet]\nnum_clients = 3\n[model]\nname = "mlp"\nhidden = [16]\n'
)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    return err.strip()


# -- a closed pipe ------------------------------------------------------------------------
def closed_pipe() -> int:
    """The writing end of a pipe whose reader has gone before a byte was written."""
    read, write = os.pipe()
    os.close(read)
    return write


@pytest.mark.parametrize("argv", [["fleet", "CONFIG"], ["--version"]])
def test_a_closed_pipe_ends_the_command_quietly(tiny, tmp_path, argv):
    """``radbo fleet CONFIG | head -5`` with head gone: no traceback (it used to end in a
    BrokenPipeError traceback, exit 1), including at interpreter exit. A command ends with
    128 + SIGPIPE, as one that SIGPIPE ends; argparse's own --help / --version output
    swallows the error and ends with 0."""
    write = closed_pipe()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "radbo", *[str(tiny) if a == "CONFIG" else a for a in argv]],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            cwd=tmp_path,
        )
    finally:
        os.close(write)

    assert proc.stderr == ""
    assert proc.returncode == (EXIT_PIPE if argv[0] == "fleet" else 0)
    assert EXIT_PIPE == 141


def test_radbo_run_into_a_closed_pipe_writes_its_results_and_ends_quietly(
    tiny, tmp_path, monkeypatch
):
    """``radbo run ... | true``, in-process: the results are written before they are printed;
    the print meets the closed pipe and the command ends with EXIT_PIPE, nothing on stderr."""
    write = closed_pipe()
    stdout = io.TextIOWrapper(os.fdopen(write, "wb"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", stdout)
    out = tmp_path / "out"

    code = main(["run", str(tiny), "--quiet", "--output-dir", str(out)])

    monkeypatch.undo()
    stdout.close()  # its descriptor now writes to /dev/null: closes without an error
    assert code == EXIT_PIPE
    assert json.loads((out / "results.json").read_text())["config"]["rounds"] == 1


def test_a_broken_pipe_that_is_not_the_output_stays_a_traceback(monkeypatch, tiny, capsys):
    """A BrokenPipeError from a pipe of radbo's own (a worker's) while stdout is fine is a bug
    in radbo: it keeps its traceback."""

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(radbo.cli, "_fleet", broken)
    with pytest.raises(BrokenPipeError):
        main(["fleet", str(tiny)])


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"radbo {__version__} (Python {sys.version.split()[0]}, torch ")


# -- the run folder -----------------------------------------------------------------------
def test_resume_without_a_checkpoint_is_one_line_exit_2(tiny, tmp_path, capsys):
    out = tmp_path / "out"

    assert main(["run", str(tiny), "--quiet", "--resume", "--output-dir", str(out)]) == 2

    assert one_line(capsys.readouterr().err) == (
        f"nothing to resume in {out}: it holds no checkpoint (checkpoints/run); run without "
        "--resume to start afresh, with checkpoint_every or --checkpoint-every N to be able to "
        "resume"
    )
    assert not out.exists()


def test_an_existing_run_folder_is_refused_unless_overwrite(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["run", str(tiny), "--quiet", "--output-dir", str(out)]
    assert main(args) == 0
    before = (out / "results.json").read_bytes()
    capsys.readouterr()

    assert main([*args, "--seed", "1"]) == 2

    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"{out} already holds a run (results.json")
    assert err.endswith(
        "; pass --overwrite to replace it, --resume to continue it, or --output-dir to write "
        "elsewhere"
    )
    assert (out / "results.json").read_bytes() == before  # untouched

    # a finished run continues from its final state, checkpoints/final (nothing left to run)
    assert main([*args, "--resume"]) == 0
    capsys.readouterr()
    # one without any checkpoint cannot be resumed: the line says what to do
    shutil.rmtree(out / "checkpoints")
    assert main([*args, "--resume"]) == 2
    assert "run with --overwrite instead of --resume" in one_line(capsys.readouterr().err)

    assert main([*args, "--resume", "--overwrite"]) == 2
    assert one_line(capsys.readouterr().err) == (
        "config error: --resume continues the run in the output folder and --overwrite "
        "replaces it; give one of them"
    )

    assert main([*args, "--seed", "1", "--overwrite"]) == 0
    assert json.loads((out / "results.json").read_text())["config"]["seed"] == 1


def test_a_refused_resume_names_each_differing_key(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["run", str(tiny), "--quiet", "--output-dir", str(out), "--checkpoint-every", "1"]
    assert main(args) == 0
    capsys.readouterr()

    argv = [*args, "--resume", "algorithm.inner_lr=0.2", "model.hidden=[8]", "seed=3"]
    assert main(argv) == 2

    assert one_line(capsys.readouterr().err) == (
        f"the checkpoint in {out / 'checkpoints/run'} was written by a different config "
        "(algorithm.inner_lr: 0.1 then, 0.2 now; model.hidden: [16] then, [8] now; seed: 0 "
        "then, 3 now); use another output_dir, or start afresh without resume (radbo run "
        "--overwrite)"
    )


def test_config_differences_name_a_kind_by_its_tag_and_are_bounded():
    saved = {"algorithm": {"name": "rabo", "inner_lr": 0.1}, "rounds": 5, "fleet": {"a": 1}}
    current = {"algorithm": {"name": "fedmbo", "eta": 0.1}, "rounds": 9, "fleet": {"b": 2}}

    assert _config_differences(saved, current, ignore=("rounds",)) == [
        "algorithm.name: 'rabo' then, 'fedmbo' now",  # not each key of the other kind
        "fleet.a: 1 then, absent now",
        "fleet.b: absent then, 2 now",
    ]
    many = {f"k{i}": i for i in range(8)}
    assert len(_config_differences(many, {}, ignore=())) == 8  # the message shows 5 + "3 more"


# -- several seeds ------------------------------------------------------------------------
def fake_result(accuracy: float, seed: int) -> RunResult:
    return RunResult(
        config=RunConfig(seed=seed),
        rounds=[],
        final={"test_accuracy": accuracy},
        state=None,
        totals={"flops": 10.0, "sim_time_s": 0.0},
    )


def test_aggregate_is_the_mean_and_students_t_interval():
    runs = [fake_result(a, s) for s, a in enumerate([0.8, 0.9, 1.0])]

    aggregate = aggregate_runs(runs, [0, 1, 2], overrides=["algorithm.inner_lr=0.2"])

    row = aggregate["final"]["test_accuracy"]
    # with 2 degrees of freedom Student's t has the closed-form quantile
    # t_p = (2p - 1) / sqrt(2p (1 - p)): t_0.975 = 0.95 / sqrt(0.04875) = 4.30265...
    t = 0.95 / math.sqrt(2 * 0.975 * 0.025)
    s = statistics.stdev([0.8, 0.9, 1.0])  # 0.1 up to float rounding
    assert row["n"] == 3 and row["values"] == [0.8, 0.9, 1.0]
    assert math.isclose(row["mean"], 0.9, rel_tol=1e-15)
    assert math.isclose(row["ci95"], t * s / math.sqrt(3), rel_tol=1e-12)
    assert "seed" not in aggregate["config"] and aggregate["overrides"] == [
        "algorithm.inner_lr=0.2"
    ]
    assert aggregate_table(aggregate) == [
        "| metric | mean ± 95 % CI | n | per seed (0, 1, 2) |",
        "|---|---|---|---|",
        "| test_accuracy | 0.9 ± 0.2484 | 3 | 0.8, 0.9, 1 |",
        "| flops | 10 ± 0 | 3 | 10, 10, 10 |",  # sim_time_s is 0 in every run: not shown
    ]
    one = aggregate_runs([fake_result(0.5, 7)], [7])["final"]["test_accuracy"]
    assert (one["mean"], one["ci95"], one["std"], one["n"]) == (0.5, None, None, 1)


def test_seeds_write_one_plain_run_folder_per_seed_and_the_aggregate(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["run", str(tiny), "--quiet", "--output-dir", str(out), "--seeds", "0", "1", "2"]
    argv.append("algorithm.inner_lr=0.2")  # --seeds takes it; it is an override

    assert main(argv) == 0, capsys.readouterr().err

    runs = [json.loads((out / f"seed-{s}/results.json").read_text()) for s in (0, 1, 2)]
    assert [r["config"]["seed"] for r in runs] == [0, 1, 2]
    assert all(r["overrides"] == ["algorithm.inner_lr=0.2"] for r in runs)
    assert all(r["config"]["algorithm"]["inner_lr"] == 0.2 for r in runs)
    drop_seed = [{**r["config"], "seed": None} for r in runs]
    assert drop_seed[0] == drop_seed[1] == drop_seed[2]  # they differ only by seed
    accuracies = [r["final"]["test_accuracy"] for r in runs]
    aggregate = json.loads((out / "aggregate.json").read_text())
    row = aggregate["final"]["test_accuracy"]
    assert row["values"] == accuracies and row["n"] == 3
    assert math.isclose(row["mean"], statistics.fmean(accuracies), rel_tol=1e-15)
    half = stats.t.ppf(0.975, 2) * statistics.stdev(accuracies) / math.sqrt(3)
    assert math.isclose(row["ci95"], half, rel_tol=1e-12)
    markdown = (out / "aggregate.md").read_text()
    assert f"| test_accuracy | {row['mean']:.4g} ± {half:.4g} | 3 |" in markdown
    printed = capsys.readouterr().out
    assert f"| test_accuracy | {row['mean']:.4g} ± {half:.4g} | 3 |" in printed

    # a seed's folder is a plain run folder: what radbo run --seed 1 writes
    single = tmp_path / "single"
    argv = ["run", str(tiny), "--quiet", "--output-dir", str(single), "--seed", "1"]
    assert main([*argv, "algorithm.inner_lr=0.2"]) == 0
    assert comparable_results(single, drop=()) == comparable_results(out / "seed-1", drop=())

    # the folder now holds them: refused, in one line
    capsys.readouterr()
    assert main(["run", str(tiny), "--quiet", "--output-dir", str(out), "--seeds", "0"]) == 2
    assert one_line(capsys.readouterr().err).startswith(f"{out / 'seed-0'} already holds a run")


def test_seeds_resume_continues_some_and_starts_the_rest(tiny, tmp_path, capsys):
    """An interrupted multi-seed run: seed 0 has checkpoints, seed 1 never started."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    args = ["run", str(tiny), "--quiet", "--checkpoint-every", "1", "--seeds", "0", "1"]
    assert main([*args, "--output-dir", str(whole)]) == 0
    assert main([*args[:-1], "--output-dir", str(cut)]) == 0  # seed 0 only

    assert main([*args, "--output-dir", str(cut), "--resume"]) == 0, capsys.readouterr().err

    for seed in (0, 1):
        a, b = whole / f"seed-{seed}", cut / f"seed-{seed}"
        assert comparable_results(a, drop=()) == comparable_results(b, drop=())


@pytest.mark.parametrize(
    ("words", "message"),
    [
        (
            ["--seeds", "0", "x"],
            "config error: --seeds 'x': a seed is an integer >= 0 (--seeds 0 1 2)",
        ),
        (["--seeds", "0", "0"], "config error: seeds = [0, 0]: seed 0 is given more than once"),
        (["--seeds", "-1"], "config error: seed = -1: a seed is an integer in [0, 2^63 - 1]"),
        (
            ["--seeds", "0", "1", "--seed", "2"],
            "config error: --seeds sets the seed of each run; drop --seed / seed= from the "
            "command line",
        ),
    ],
)
def test_bad_seeds_are_one_line_exit_2(tiny, tmp_path, capsys, words, message):
    argv = ["run", str(tiny), "--quiet", "--output-dir", str(tmp_path / "out"), *words]
    assert main(argv) == 2
    assert one_line(capsys.readouterr().err) == message
    assert not (tmp_path / "out").exists()


# -- progress -----------------------------------------------------------------------------
def lines_of(total: int, initial: int = 0) -> list[str]:
    out = io.StringIO()
    bar = LineProgress(total, initial=initial, desc="radbo", file=out, clock=lambda: 0.0)
    for _ in range(total - initial):
        bar.update(1)
        bar.set_postfix({"acc": "0.500"})
    bar.close()
    return out.getvalue().splitlines()


def test_progress_lines_are_bounded_however_long_the_run():
    long = lines_of(1000)
    assert [line.split()[2] for line in long] == [f"{k}/1000" for k in range(100, 1001, 100)]
    assert long[-1] == "radbo: round 1000/1000 (100%), acc 0.500, 0.0 s"
    assert len(lines_of(25)) == 9  # every 3 rounds (3, ..., 24) and the last
    assert len(lines_of(7)) == 7  # short runs: a line a round
    resumed = lines_of(1000, initial=550)  # the marks still fall on the tenths of the run
    assert [line.split()[2] for line in resumed] == [f"{k}/1000" for k in range(600, 1001, 100)]


def test_a_run_writes_a_few_progress_lines_to_a_non_terminal(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["run", str(tiny), "--rounds", "30", "--output-dir", str(out)]) == 0

    err = capsys.readouterr().err.splitlines()  # pytest's capture is not a terminal
    assert len(err) == 10
    assert err[0].startswith("radbo: round 3/30 (10%), outer ")
    assert err[-1].startswith("radbo: round 30/30 (100%), outer ")


def test_a_terminal_gets_the_redrawn_bar(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress_bar(10, desc="radbo")
    try:
        assert not isinstance(bar, LineProgress) and type(bar).__module__.startswith("tqdm")
    finally:
        bar.close()


# -- the τ of a drawn schedule --------------------------------------------------------------
def uniform_config(schedule: str, devices: bool = False) -> RunConfig:
    fleet = {"num_clients": 6, "local_steps": schedule, "local_steps_range": [2, 9]}
    if devices:
        fleet["devices"] = {"phone_low": 1.0}
    data = {
        "rounds": 4,
        "fleet": fleet,
        "model": {"name": "mlp", "hidden": [16]},
        "mask": {"policy": "none"},
        "algorithm": {"name": "shrofbo"},
    }
    return parse_config(data)


def test_fleet_shows_the_tau_each_client_draws_once():
    """ShroFBO with local_steps = "uniform": the table's τ is what the run uses in every
    round (it showed the algorithm's tau = 5 for everyone)."""
    config = uniform_config("uniform")

    rows = fleet_table(config)

    sim = build(config).simulation
    for round_ in range(config.rounds):
        used = [b.local_steps for b in sim.round_budgets(round_, range(6))]
        assert [row["local_steps"] for row in rows] == used
    assert all(2 <= row["local_steps"] <= 9 for row in rows)
    assert len({row["local_steps"] for row in rows}) > 1
    assert {(row["local_steps_schedule"], tuple(row["local_steps_range"])) for row in rows} == {
        ("uniform", (2, 9))
    }


def test_fleet_shows_the_range_of_a_tau_drawn_every_round(tmp_path, capsys):
    config = uniform_config("uniform_per_round", devices=True)

    rows = fleet_table(config)

    assert [row["local_steps"] for row in rows] == [None] * 6
    exp = build(config)
    for i, row in enumerate(rows):  # round time: its mean over τ uniform on {2, ..., 9}
        expected = statistics.fmean(
            exp.planner.at(exp.fleet[i], row["capacity"], tau).round_time_s for tau in range(2, 10)
        )
        assert math.isclose(row["round_time_s"], expected, rel_tol=1e-12)

    path = tmp_path / "fleet.toml"
    path.write_text(
        'rounds = 1\n[fleet]\nnum_clients = 2\nlocal_steps = "uniform_per_round"\n'
        'local_steps_range = [2, 9]\n[model]\nname = "mlp"\nhidden = [16]\n[mask]\n'
        'policy = "none"\n[algorithm]\nname = "shrofbo"\n'
    )
    assert main(["fleet", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[-1] for line in lines[1:3]] == ["2-9", "2-9"]
    assert lines[-1] == "tau: drawn afresh every round, uniform on {2, ..., 9}"


def test_the_progress_doctest_holds():
    import doctest

    import radbo.experiment.progress

    result = doctest.testmod(radbo.experiment.progress)
    assert result.failed == 0 and result.attempted >= 5
