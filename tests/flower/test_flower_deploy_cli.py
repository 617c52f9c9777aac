"""``radbo flower deploy-local``: its arguments, its one-line errors, and what it hands the
deployment (the packaged Flower app, node data, node configs, logs in the output folder),
checked with a stand-in for :class:`radbo.flower.deploy.LocalDeployment`; and (slow) the
command for real, from the interpreter radbo runs in."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import radbo.flower.deploy as deploy
from radbo.cli import main
from radbo.flower.deploy import APP_DIR, RunStatus

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "flower" / "tiny.toml"
# two clients, the server sends example indices ([flower] data = "server", the default)
SERVER_DATA = """\
rounds = 1
output_dir = "runs/served"
[fleet]
num_clients = 2
[mask]
policy = "leading"
"""


class FakeDeployment:
    """Records what deploy_local gives LocalDeployment; runs nothing."""

    made: list["FakeDeployment"] = []
    status = "finished:completed"
    radbo: dict | None = {"status": "completed"}
    interrupt = False

    def __init__(self, app_dir, num_nodes, node_config, flwr_home=None, log_dir=None, **kw):
        self.app_dir = Path(app_dir)
        self.num_nodes = num_nodes
        self.node_config = node_config
        self.flwr_home = flwr_home
        self.log_dir = Path(log_dir)
        self.kw = kw
        self.runs: list[tuple[dict, float]] = []
        self.entered = self.exited = False
        FakeDeployment.made.append(self)

    def __enter__(self):
        self.entered = True
        return self

    def __exit__(self, *exc):
        self.exited = True

    def run(self, run_config, timeout_s):
        self.runs.append((dict(run_config), timeout_s))
        if self.interrupt:
            raise KeyboardInterrupt
        return RunStatus(run_id=7, status=self.status, details="", wall_s=1.0, radbo=self.radbo)

    def leftovers(self):
        return []

    def process_counts(self):
        return {"flower-superlink": 1, "flower-supernode": self.num_nodes}


@pytest.fixture
def fake(monkeypatch):
    FakeDeployment.made = []
    monkeypatch.setattr(deploy, "LocalDeployment", FakeDeployment)
    return FakeDeployment


def deploy_local(*args: str) -> int:
    return main(["flower", "deploy-local", *args])


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ----------------------------------------------------------------------------- what it starts


def test_node_data_config_gets_the_app_its_data_and_logs_in_the_output_folder(
    fake, tmp_path, capsys
):
    out = tmp_path / "out"
    assert deploy_local(str(TINY), "--output", str(out), "--timeout", "99") == 0
    [made] = fake.made
    # the Flower app radbo ships, copied into the output folder (flwr run bundles that folder)
    assert made.app_dir == out / "app"
    assert sorted(p.name for p in made.app_dir.iterdir()) == ["pyproject.toml"]
    assert (made.app_dir / "pyproject.toml").read_bytes() == (
        APP_DIR / "pyproject.toml"
    ).read_bytes()
    # one SuperNode per client, each on its own client's data written under nodes/
    assert made.num_nodes == 3
    for i in range(3):
        folder = out / "nodes" / f"client-{i}"
        assert made.node_config(i) == {"partition-id": i, "data-root": str(folder)}
        assert json.loads((folder / "node.json").read_text())["client"] == i
    # logs kept in the output folder (not in a temporary folder removed at exit)
    assert made.log_dir == out / "logs"
    assert made.kw["env"]["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
    assert made.runs == [({"radbo-config": str(TINY), "output-dir": str(out), "save": True}, 99.0)]
    assert made.entered and made.exited
    stdout = capsys.readouterr().out
    assert f"results: {out / 'results.json'}" in stdout
    assert f"logs:    {out / 'logs'}" in stdout


def test_server_data_config_sends_indices_and_writes_no_node_data(fake, tmp_path, monkeypatch):
    config = tmp_path / "served.toml"
    config.write_text(SERVER_DATA)
    monkeypatch.chdir(tmp_path)  # the default output is the config's output_dir
    assert deploy_local(str(config)) == 0
    [made] = fake.made
    out = tmp_path / "runs" / "served"
    assert made.num_nodes == 2
    assert [made.node_config(i) for i in range(2)] == [{"partition-id": 0}, {"partition-id": 1}]
    assert not (out / "nodes").exists()
    assert made.runs[0][0]["output-dir"] == str(out)
    assert made.runs[0][0]["radbo-config"] == str(config)
    assert made.runs[0][1] == 1800.0  # the default timeout


def test_node_config_template_replaces_the_written_node_data(fake, tmp_path):
    out = tmp_path / "out"
    template = 'partition-id={i} data-root="/data/dev{i}"'
    assert deploy_local(str(TINY), "--output", str(out), "--node-config", template) == 0
    [made] = fake.made
    assert made.node_config(2) == {"partition-id": 2, "data-root": "/data/dev2"}
    assert not (out / "nodes").exists()


def test_a_run_that_did_not_complete_exits_1_naming_the_error_and_the_logs(
    fake, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(FakeDeployment, "status", "finished:failed")
    monkeypatch.setattr(
        FakeDeployment, "radbo", {"status": "failed", "error": "ValueError: bad node\nmore"}
    )
    out = tmp_path / "out"
    assert deploy_local(str(TINY), "--output", str(out)) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"deploy error: run 7 did not complete (finished:failed: ValueError: bad node); see "
        f"{out / 'logs'} and {out / 'status.json'}"
    )


def test_interrupt_stops_the_deployment_and_exits_130(fake, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(FakeDeployment, "interrupt", True)
    assert deploy_local(str(TINY), "--output", str(tmp_path / "out")) == 130
    [made] = fake.made
    assert made.exited  # left through the context manager: every process stopped
    assert "interrupted" in one_line(capsys.readouterr().err)


# ----------------------------------------------------------------------------- refusals


def refused(capsys, fake, *args: str) -> str:
    """The one stderr line of a deploy-local refused with exit code 2 before any start."""
    assert deploy_local(*args) == 2
    assert fake.made == []
    return one_line(capsys.readouterr().err)


def test_missing_config_is_one_line(fake, tmp_path, capsys):
    line = refused(capsys, fake, str(tmp_path / "nope.toml"))
    assert "nope.toml" in line and line.startswith("config error")


def test_invalid_config_is_one_line(fake, tmp_path, capsys):
    config = tmp_path / "bad.toml"
    config.write_text("rounds = 0\n")
    line = refused(capsys, fake, str(config))
    assert line == "config error: rounds = 0: Input should be greater than or equal to 1"


def test_output_folder_holding_a_run_is_refused(fake, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "status.json").write_text("{}")
    (out / "logs").mkdir()
    line = refused(capsys, fake, str(TINY), "--output", str(out))
    assert line == (
        f"deploy error: {out} already holds a deployment's files (status.json, logs): give a "
        "new output folder, or remove them"
    )
    assert sorted(p.name for p in out.iterdir()) == ["logs", "status.json"]  # nothing written


def test_output_that_is_a_file_is_refused(fake, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("")
    line = refused(capsys, fake, str(TINY), "--output", str(out))
    assert line == f"deploy error: {out} is a file, not a folder: give an output folder"


@pytest.mark.parametrize("timeout", ["0", "-5", "nan"])
def test_timeout_must_be_positive(fake, tmp_path, capsys, timeout):
    line = refused(capsys, fake, str(TINY), "--output", str(tmp_path), "--timeout", timeout)
    assert line.startswith(f"deploy error: timeout = {float(timeout):g} s: give a positive")


def test_malformed_node_config_template_is_refused(fake, tmp_path, capsys):
    line = refused(
        capsys, fake, str(TINY), "--output", str(tmp_path), "--node-config", "data-root=/d{i}"
    )
    assert line.startswith("deploy error: --node-config 'data-root=/d{i}' is not")
    assert 'quote strings, e.g. data-root="/data/dev{i}"' in line


def test_without_flower_the_line_says_what_to_install(fake, tmp_path, capsys, monkeypatch):
    real = deploy.importlib.util.find_spec
    monkeypatch.setattr(
        deploy.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flwr" else real(name, *a),
    )
    line = refused(capsys, fake, str(TINY), "--output", str(tmp_path))
    assert line == (
        f"deploy error: Flower is not installed in the environment radbo runs in "
        f"({sys.executable}): pip install 'radbo[flower]'"
    )


def test_the_shipped_app_is_package_data():
    """The app deploy-local copies is in the wheel: pyproject's package data names it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["radbo"]
    assert "flower/app/pyproject.toml" in patterns
    assert APP_DIR == ROOT / "radbo" / "flower" / "app"


# ----------------------------------------------------------------------------- for real


@pytest.mark.slow
def test_deploy_local_for_real_from_radbo_s_own_interpreter(tmp_path):
    """The command a pip user runs: the radbo script of this environment, with a PATH that
    has no Python of its own (the script used the system `python`, which had no torch).
    About 2 minutes on a busy 2-core machine: the daemons' start, ~13 s a round (Flower's
    polling), the node data and this process's imports."""
    pytest.importorskip("flwr", reason="flwr is not installed (pip install 'radbo[flower]')")
    out = tmp_path / "out"
    radbo = Path(sys.executable).parent / "radbo"
    env = {**os.environ, "PATH": "/usr/bin:/bin", "RADBO_WORKER_DIR": str(tmp_path / "w")}
    done = subprocess.run(
        [str(radbo), "flower", "deploy-local", str(TINY), "--output", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"results: {out / 'results.json'}" in done.stdout
    results = json.loads((out / "results.json").read_text())
    assert len(results["rounds"]) == 2
    assert 0.0 < results["final"]["test_accuracy"] <= 1.0
    assert json.loads((out / "status.json").read_text())["status"] == "completed"
    logs = {p.name for p in (out / "logs").iterdir()}
    assert {"superlink.log", "run-1.log", "run-config-1.toml"} <= logs
    assert {f"supernode-{i}.log" for i in range(3)} <= logs
    assert "still alive: none" in done.stderr
