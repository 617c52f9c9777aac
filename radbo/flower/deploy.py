"""A Flower deployment on one machine: a SuperLink and N SuperNodes as real processes.

:class:`LocalDeployment` is what ``radbo flower deploy-local`` (:func:`deploy_local`) and the
deployment test run. It starts the same processes a deployment on real machines starts, with
the flags of the installed Flower (1.41, 1.42), taking the programs from the environment radbo
runs in (the folder of ``sys.executable`` first, then ``PATH``):

* ``flower-superlink --insecure --disable-runtime-dependency-installation --host 127.0.0.1
  --port <P>``: since flwr 1.41 the SuperLink serves its Fleet, Control and Runtime APIs over
  HTTP on that one port. Dependency installation is disabled because the app's dependency,
  radbo, is already installed (the SuperLink would otherwise ``uv sync`` it).
* one ``flower-supernode --insecure --superlink 127.0.0.1:<P> --port <Q_i> --node-config
  <node-i.toml>`` per node: ``--port`` is the node's own Runtime API port (each node needs its
  own), the node config (``partition-id = i`` by default) is written to a TOML file, which
  ``--node-config`` accepts as well as ``'k=v k=v'`` text.
* ``flwr run <app_dir> <connection> --run-config <run-config.toml> --format json``, then
  ``flwr log <run id> --stream`` (to a log file) until the run ends, then
  ``flwr ls --run-id <run id> --format json`` for its status: ``flwr run`` itself reports
  success once the run is submitted, whatever the ServerApp does later.

The ``flwr`` CLI reads its connection from ``$FLWR_HOME/config.toml`` (not from the app's
pyproject); the deployment writes one there (:func:`write_connection_config`).

Processes. Every daemon starts in its own session (process group); a sampler thread records
every process they start (Flower's ``flower-superexec``, a ``flwr-serverapp`` per run, a
``flwr-clientapp`` per message, and whatever those start) while it is alive. On exit the
deployment sends SIGTERM to its process groups, waits, sends SIGKILL, then waits (bounded)
for every recorded process to be gone; one that outlives its group by ``grace_s`` is killed
by PID and listed in :attr:`LocalDeployment.stragglers`. :meth:`LocalDeployment.leftovers`
lists the recorded processes still alive.

:func:`deploy_local` is the whole job of ``radbo flower deploy-local``: it copies the Flower
app radbo ships (:data:`APP_DIR`, whose ``pyproject.toml`` names radbo's ServerApp and
ClientApp) to ``<output>/app``, writes each client's data to ``<output>/nodes`` when the config
says ``[flower] data = "node"``, starts one SuperNode per client, runs the config and keeps
every log in ``<output>/logs``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import psutil

from radbo.atomic import atomic_write_text
from radbo.tomlfile import toml_lines, toml_string

if TYPE_CHECKING:
    from radbo.config import RunConfig

#: A run- or node-config value, as Flower's config records hold them.
Scalar = str | int | float | bool

#: Name of the connection :class:`LocalDeployment` writes to ``$FLWR_HOME/config.toml``.
CONNECTION = "radbo-local"
#: ``flwr ls`` status of a run that finished without error.
COMPLETED = "finished:completed"
#: The Flower app radbo ships: a ``pyproject.toml`` naming ``radbo.flower.apps:server_app``
#: and ``radbo.flower.clientapp:client_app`` and declaring the run config keys
#: ``radbo-config``, ``output-dir`` and ``save``.
APP_DIR = Path(__file__).resolve().parent / "app"
#: Files in an output folder that mean a deployment already ran there.
_RUN_FILES = ("results.json", "status.json", "logs")


class DeploymentError(RuntimeError):
    """The local Flower deployment could not be started or driven."""


# ----------------------------------------------------------------------------- helpers


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now (held open together while picked,
    so they differ; another program may still take one before it is used)."""
    if count < 0:
        raise ValueError(f"free_ports: count = {count}; give a count >= 0")
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def flat_toml(values: Mapping[str, Scalar]) -> str:
    """A flat TOML document of ``values`` (keys quoted unless bare); :class:`TypeError` for a
    value Flower's configs cannot hold."""
    for value in values.values():
        if not isinstance(value, str | int | float | bool):
            raise TypeError(
                f"config value {value!r} has type {type(value).__name__}; Flower configs take "
                "str, int, float or bool"
            )
    return "\n".join(toml_lines(values)) + "\n"


def connection_toml(
    address: str,
    *,
    name: str = CONNECTION,
    insecure: bool = True,
    root_certificates: str | Path | None = None,
) -> str:
    """The ``$FLWR_HOME/config.toml`` text with one SuperLink connection ``name`` (the
    default) at ``address`` (``host:port``)."""
    lines = [
        "[superlink]",
        f"default = {toml_string(name)}",
        "",
        f"[superlink.{name}]",
        f"address = {toml_string(address)}",
    ]
    if insecure:
        lines.append("insecure = true")
    if root_certificates is not None:
        lines.append(f"root-certificates = {toml_string(str(root_certificates))}")
    return "\n".join(lines) + "\n"


def write_connection_config(flwr_home: str | Path, address: str, *, name: str = CONNECTION) -> Path:
    """Write ``$FLWR_HOME/config.toml`` (insecure connection ``name`` at ``address``)."""
    path = Path(flwr_home) / "config.toml"
    atomic_write_text(path, connection_toml(address, name=name))
    return path


def default_node_config(index: int) -> dict[str, Scalar]:
    """Node ``index`` serves radbo client ``index``."""
    return {"partition-id": index}


def _label(proc: psutil.Process) -> str:
    """A process's program: the first ``flwr*`` / ``flower-*`` word of its command line,
    else its name; ``"<program> (fork)"`` for a child seen between fork and exec (a SuperNode
    starting a ``flwr-clientapp``), which still runs its parent's command line.

    The command line is read once, and the fork test compares that same reading with the
    parent's: read twice, a child that execs in between was named by its parent's program
    and judged by its new one, so counted as a second copy of its parent (a second
    ``flower-superlink`` in a test, once)."""
    try:
        cmdline = proc.cmdline()
        name = proc.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"
    label = name
    for word in cmdline[:2]:
        base = os.path.basename(word)
        if base.startswith(("flwr", "flower")):
            label = base
            break
    return f"{label} (fork)" if _fork_image(proc, cmdline) else label


def _fork_image(proc: psutil.Process, cmdline: list[str]) -> bool:
    """Whether ``cmdline``, read from ``proc``, is its parent's command line: a child seen
    between fork and exec, not a second copy of the parent's program."""
    try:
        parent = proc.parent()
        return parent is not None and parent.cmdline() == cmdline
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie holds nothing; its parent or init reaps it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return proc.is_running()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


def _json_object(text: str) -> dict[str, Any]:
    """The JSON object in a ``flwr ... --format json`` output (warnings may precede it)."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the output")
    value = json.loads(text[start : end + 1])
    if not isinstance(value, dict):
        raise ValueError("the output is JSON but not an object")
    return value


# ----------------------------------------------------------------------------- deployment


@dataclass(frozen=True)
class RunStatus:
    """How a ``flwr run`` on the deployment ended.

    ``status`` is ``flwr ls``'s (``finished:completed``, ``finished:failed``,
    ``finished:stopped``; ``running`` etc. when ``timed_out``), ``details`` its status
    details; ``radbo`` is ``<output-dir>/status.json`` when the ServerApp wrote one;
    ``wall_s`` the seconds from submitting the run to its end.
    """

    run_id: int
    status: str
    details: str
    wall_s: float
    timed_out: bool = False
    radbo: dict[str, Any] | None = None
    flwr: dict[str, Any] = field(default_factory=dict)

    @property
    def completed(self) -> bool:
        """Flower finished the run without error (and radbo, when it wrote its status,
        says ``completed``)."""
        radbo_ok = self.radbo is None or self.radbo.get("status") == "completed"
        return not self.timed_out and self.status == COMPLETED and radbo_ok


@dataclass
class Daemon:
    """A process :class:`LocalDeployment` started (leader of its own process group)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: TextIO


class LocalDeployment:
    """A SuperLink and ``num_nodes`` SuperNodes on ``host`` (loopback), as a context manager.

    ``node_config(i)`` is node ``i``'s node config (default ``{"partition-id": i}``).
    ``flwr_home`` is the ``flwr`` CLI's home (``config.toml`` with the connection; each
    daemon gets its own ``FLWR_HOME`` below it); ``log_dir`` (default ``<flwr_home>/logs``)
    gets one log per process, the run configs and each run's log. Without ``flwr_home`` a
    temporary folder is used and removed on exit (logs included). ``env`` adds environment
    variables to every process started (e.g. ``OMP_NUM_THREADS=1``). All processes run in
    ``app_dir``, so the app's relative run-config defaults resolve there.

    Entering starts the daemons and waits up to ``start_timeout_s`` until the SuperLink lists
    ``num_nodes`` online nodes; exiting stops everything (see the module docstring), also
    when entering or the body fails.
    """

    def __init__(
        self,
        app_dir: str | Path,
        num_nodes: int = 3,
        node_config: Callable[[int], Mapping[str, Scalar]] | None = None,
        flwr_home: str | Path | None = None,
        log_dir: str | Path | None = None,
        *,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 120.0,
        grace_s: float = 15.0,
        echo: TextIO | None = None,
        pid_file: str | Path | None = None,
    ) -> None:
        self.app_dir = Path(app_dir).resolve()
        if not (self.app_dir / "pyproject.toml").is_file():
            raise DeploymentError(
                f"{self.app_dir} has no pyproject.toml: give the folder of a Flower app "
                "(e.g. examples/flower)"
            )
        if num_nodes < 1:
            raise DeploymentError(f"num_nodes = {num_nodes}: start at least one SuperNode")
        self.num_nodes = num_nodes
        self.node_config = node_config or default_node_config
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if flwr_home is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="radbo-flwr-")
            flwr_home = self._tmp.name
        self.flwr_home = Path(flwr_home).resolve()
        self.log_dir = Path(log_dir).resolve() if log_dir is not None else self.flwr_home / "logs"
        self.host = host
        self.extra_env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.echo = echo
        self.pid_file = Path(pid_file) if pid_file is not None else None
        self.port: int | None = None
        self.node_ports: list[int] = []
        self.stragglers: list[tuple[int, str]] = []
        self._daemons: list[Daemon] = []
        self._nodes: list[Daemon] = []
        self._killed: set[int] = set()
        self._seen: dict[tuple[int, float], psutil.Process] = {}
        self._labels: dict[tuple[int, float], str] = {}
        self._cpu: dict[tuple[int, float], float] = {}
        self._lock = threading.Lock()
        self._stop_sampling = threading.Event()
        self._sampler: threading.Thread | None = None
        self._runs = 0
        bin_dir = Path(sys.executable).parent
        self._bin = bin_dir if (bin_dir / "flwr").exists() else None

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> LocalDeployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ processes

    @property
    def address(self) -> str:
        """The SuperLink's address (``host:port``): the Fleet API of the SuperNodes and the
        Control API of ``flwr``."""
        if self.port is None:
            raise DeploymentError("the deployment is not started: use it as a context manager")
        return f"{self.host}:{self.port}"

    def _program(self, name: str) -> str:
        if self._bin is not None and (self._bin / name).exists():
            return str(self._bin / name)
        found = shutil.which(name)
        if found is None:
            raise DeploymentError(
                f"{name} is not on PATH: install Flower in this environment "
                "(pip install 'radbo[flower]')"
            )
        return found

    def _env(self, flwr_home: Path) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        env["FLWR_HOME"] = str(flwr_home)
        env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
        if self._bin is not None:
            # the daemons start flower-superexec, flwr-serverapp and flwr-clientapp by name
            env["PATH"] = f"{self._bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    def _say(self, text: str) -> None:
        if self.echo is not None:
            print(text, file=self.echo, flush=True)

    def spawn(self, name: str, argv: Sequence[str], flwr_home: Path) -> Daemon:
        """Start ``argv`` in a session of its own, in ``app_dir``, with ``FLWR_HOME =
        flwr_home`` and output to ``<log_dir>/<name>.log``; it is stopped with the rest."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        flwr_home.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("w")
        self._say(f"[deploy] {name}: {' '.join(argv)}  (log: {log.name})")
        try:
            popen = subprocess.Popen(
                list(argv),
                cwd=self.app_dir,
                env=self._env(flwr_home),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except BaseException:
            log.close()
            raise
        daemon = Daemon(name, popen, log)
        self._daemons.append(daemon)
        self._record(popen.pid)
        return daemon

    def _record(self, pid: int) -> None:
        """Remember process ``pid`` (once; keyed by PID and start time) and its CPU time."""
        try:
            proc = psutil.Process(pid)
            key = (proc.pid, proc.create_time())
        except psutil.Error:
            return
        with self._lock:
            if key not in self._seen:
                self._seen[key] = proc
                self._labels[key] = "?"
                if self.pid_file is not None:
                    with self.pid_file.open("a") as fh:
                        fh.write(f"{proc.pid}\n")
            proc = self._seen[key]
        # a child seen between fork and exec still shows its parent's command line: it is
        # counted as a fork until a later sample sees the program it became (a child that
        # exits before that stays a fork, not one more of its parent's program)
        label = _label(proc)
        if label != "?":
            with self._lock:
                self._labels[key] = label
        try:
            times = proc.cpu_times()
        except psutil.Error:
            return
        with self._lock:
            self._cpu[key] = max(self._cpu.get(key, 0.0), times.user + times.system)

    def _sample(self) -> None:
        """Record every live descendant of the daemons, and everyone's CPU time so far."""
        for daemon in list(self._daemons):
            self._record(daemon.popen.pid)
            try:
                children = psutil.Process(daemon.popen.pid).children(recursive=True)
            except psutil.Error:
                continue
            for child in children:
                self._record(child.pid)

    def _sample_loop(self) -> None:
        while not self._stop_sampling.wait(0.1):
            self._sample()

    def start(self) -> None:
        """Write the connection config, start the SuperLink and the SuperNodes, wait until
        every node is online."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ports = free_ports(1 + self.num_nodes, self.host)
        self.port, self.node_ports = ports[0], ports[1:]
        write_connection_config(self.flwr_home, self.address)
        self._sampler = threading.Thread(target=self._sample_loop, daemon=True)
        self._sampler.start()
        link = self.spawn(
            "superlink",
            [
                self._program("flower-superlink"),
                "--insecure",
                "--disable-runtime-dependency-installation",
                "--host",
                self.host,
                "--port",
                str(self.port),
            ],
            self.flwr_home / "superlink",
        )
        deadline = time.monotonic() + self.start_timeout_s
        self._wait_healthy(link, deadline)
        for i, port in enumerate(self.node_ports):
            config = dict(self.node_config(i))
            config_file = self.log_dir / f"node-{i}.toml"
            atomic_write_text(config_file, flat_toml(config))
            node = self.spawn(
                f"supernode-{i}",
                [
                    self._program("flower-supernode"),
                    "--insecure",
                    "--superlink",
                    self.address,
                    "--port",
                    str(port),
                    "--node-config",
                    str(config_file),
                ],
                self.flwr_home / f"supernode-{i}",
            )
            self._nodes.append(node)
        self._wait_nodes(deadline)

    def _check_alive(self) -> None:
        for daemon in self._daemons:
            code = daemon.popen.poll()
            if code is not None and daemon.popen.pid not in self._killed:
                raise DeploymentError(
                    f"{daemon.name} exited with code {code} (log: {daemon.log.name}); its "
                    f"last lines:\n{_tail(Path(daemon.log.name))}"
                )

    def _wait_healthy(self, link: Daemon, deadline: float) -> None:
        import httpx  # a dependency of flwr

        url = f"http://{self.address}/health"
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if httpx.get(url, timeout=2.0).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise DeploymentError(
            f"the SuperLink did not answer {url} within {self.start_timeout_s:.0f} s (log: "
            f"{link.log.name}); its last lines:\n{_tail(Path(link.log.name))}"
        )

    def online_nodes(self) -> list[int]:
        """Node ids the SuperLink lists as online (``flwr supernode ls``)."""
        out = self.flwr("supernode", "ls", CONNECTION, "--format", "json")
        nodes = out.get("nodes", [])
        return [int(n["node-id"]) for n in nodes if n.get("status") == "online"]

    def _wait_nodes(self, deadline: float) -> None:
        online: list[int] = []
        while time.monotonic() < deadline:
            self._check_alive()
            online = self.online_nodes()
            if len(online) >= self.num_nodes:
                return
            time.sleep(1.0)
        raise DeploymentError(
            f"only {len(online)} of {self.num_nodes} SuperNodes came online within "
            f"{self.start_timeout_s:.0f} s; see the supernode-*.log files in {self.log_dir}"
        )

    def flwr(self, *args: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """Run ``flwr <args>`` (which must include ``--format json``) against the deployment
        and return its JSON output; a failure raises :class:`DeploymentError`."""
        argv = [self._program("flwr"), *args]
        try:
            done = subprocess.run(
                argv,
                cwd=self.app_dir,
                env=self._env(self.flwr_home),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise DeploymentError(
                f"`flwr {' '.join(args)}` did not return within {timeout_s:.0f} s"
            ) from None
        try:
            out = _json_object(done.stdout)
        except ValueError:
            raise DeploymentError(
                f"`flwr {' '.join(args)}` exited with code {done.returncode} without a JSON "
                f"answer: {(done.stdout + done.stderr).strip()[-800:]}"
            ) from None
        if not out.get("success", False):
            raise DeploymentError(
                f"`flwr {' '.join(args)}` failed: {out.get('error-message', out.get('error', out))}"
            )
        return out

    # ------------------------------------------------------------------ runs

    def run(self, run_config: Mapping[str, Scalar], timeout_s: float = 600.0) -> RunStatus:
        """Run the app with ``run_config`` overrides (keys of the app's
        ``[tool.flwr.app.config]``) and wait until it ends or ``timeout_s`` passes (then
        the run is stopped with ``flwr stop``). The run's log goes to
        ``<log_dir>/run-<n>.log``."""
        self._runs += 1
        config_file = self.log_dir / f"run-config-{self._runs}.toml"
        atomic_write_text(config_file, flat_toml(run_config))
        started = time.monotonic()
        deadline = started + timeout_s
        submitted = self.flwr(
            "run",
            str(self.app_dir),
            CONNECTION,
            "--run-config",
            str(config_file),
            "--format",
            "json",
        )
        run_id = int(submitted["run-id"])
        self._say(f"[deploy] run {run_id} submitted; log: {self.log_dir}/run-{self._runs}.log")
        self._stream_log(run_id, self.log_dir / f"run-{self._runs}.log", deadline)
        info = self._run_info(run_id)
        while not str(info.get("status", "")).startswith("finished"):
            if time.monotonic() >= deadline:
                break
            time.sleep(2.0)
            info = self._run_info(run_id)
        timed_out = not str(info.get("status", "")).startswith("finished")
        if timed_out:
            try:
                self.flwr("stop", str(run_id), CONNECTION, "--format", "json")
            except DeploymentError as err:
                self._say(f"[deploy] could not stop run {run_id}: {err}")
        wall = time.monotonic() - started
        radbo = None
        out_dir = run_config.get("output-dir")
        if isinstance(out_dir, str) and out_dir:
            status_file = (self.app_dir / out_dir) / "status.json"
            if status_file.is_file():
                radbo = json.loads(status_file.read_text())
        return RunStatus(
            run_id=run_id,
            status=str(info.get("status", "unknown")),
            details=str(info.get("status-details", "")),
            wall_s=wall,
            timed_out=timed_out,
            radbo=radbo,
            flwr=info,
        )

    def _run_info(self, run_id: int) -> dict[str, Any]:
        out = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
        runs = out.get("runs", [])
        if not runs:
            raise DeploymentError(f"`flwr ls --run-id {run_id}` lists no run {run_id}")
        info = runs[0]
        return info if isinstance(info, dict) else {}

    def _stream_log(self, run_id: int, path: Path, deadline: float) -> None:
        """``flwr log <run id> --stream`` into ``path``; returns when the stream ends (the
        run finished) or at ``deadline``."""
        with path.open("w") as log:
            proc = subprocess.Popen(
                [self._program("flwr"), "log", str(run_id), CONNECTION, "--stream"],
                cwd=self.app_dir,
                env=self._env(self.flwr_home),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._record(proc.pid)
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            finally:
                _stop_group(proc, grace_s=5.0)

    # ------------------------------------------------------------------ failures and cleanup

    def kill_node(self, index: int) -> int:
        """SIGKILL SuperNode ``index`` (its process only, as a crash would; its superexec
        and app processes notice on their own). Returns its PID."""
        if not 0 <= index < len(self._nodes):
            raise DeploymentError(
                f"no SuperNode {index}: this deployment has nodes 0..{len(self._nodes) - 1}"
            )
        node = self._nodes[index]
        self._sample()
        self._killed.add(node.popen.pid)
        node.popen.kill()
        node.popen.wait()
        self._say(f"[deploy] killed {node.name} (pid {node.popen.pid})")
        return node.popen.pid

    def node_pids(self) -> list[int]:
        """The SuperNodes' PIDs, by node index."""
        return [node.popen.pid for node in self._nodes]

    def pids(self) -> set[int]:
        """Every PID this deployment started or saw descend from what it started."""
        self._sample()
        with self._lock:
            return {pid for pid, _ in self._seen}

    def process_counts(self) -> Counter[str]:
        """How many processes of each program were recorded (``flwr-clientapp``: one per
        message Flower ran; short-lived ones are recorded when the sampler, every 0.1 s, saw
        them; a child seen only between fork and exec counts as ``"<parent's program>
        (fork)"``)."""
        self._sample()
        with self._lock:
            return Counter(self._labels.values())

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user + system) per program, summed over its processes: the last value
        the sampler read while each was alive, so a lower bound for short-lived ones."""
        self._sample()
        totals: dict[str, float] = {}
        with self._lock:
            for key, cpu in self._cpu.items():
                label = self._labels[key]
                totals[label] = totals.get(label, 0.0) + cpu
        return totals

    def _processes(self) -> Iterator[tuple[psutil.Process, str]]:
        with self._lock:
            items = [(p, self._labels[k]) for k, p in self._seen.items()]
        yield from items

    def leftovers(self) -> list[tuple[int, str]]:
        """``(pid, program)`` of recorded processes still alive."""
        return [(p.pid, label) for p, label in self._processes() if _alive(p)]

    def stop(self) -> None:
        """Stop every process group started (SIGTERM, ``grace_s``, SIGKILL), then kill by PID
        any recorded process that outlived its group (listed in :attr:`stragglers`) and wait
        until all are gone. Safe to call twice."""
        if self._sampler is not None:
            self._sample()
            self._stop_sampling.set()
            self._sampler.join(timeout=5.0)
            self._sampler = None
        self._sample()
        daemons, self._daemons = self._daemons, []
        for daemon in daemons:
            _signal_group(daemon.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for daemon in daemons:
            try:
                daemon.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for daemon in daemons:
            _signal_group(daemon.popen.pid, signal.SIGKILL)
            try:
                daemon.popen.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
            daemon.log.close()
        # descendants in sessions of their own (flower-superexec) exit when their parent is
        # gone (Flower polls every 0.2 s): give them the grace time, then kill by PID
        self._wait_gone(self.grace_s)
        for proc, label in self._processes():
            if _alive(proc):
                self.stragglers.append((proc.pid, label))
                try:
                    proc.kill()
                except psutil.Error:
                    pass
        self._wait_gone(5.0)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _wait_gone(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


# ------------------------------------------------------------------ radbo flower deploy-local


def node_config_template(template: str) -> Callable[[int], dict[str, Scalar]]:
    """Node config ``i`` from ``'k=v k2="text {i}"'`` (TOML values; ``{i}`` = node index)."""
    import tomllib

    pattern = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")

    def config(i: int) -> dict[str, Scalar]:
        text = template.replace("{i}", str(i))
        pairs = pattern.findall(text)
        if not pairs:
            raise DeploymentError(
                f"--node-config {template!r} has no key=value pair: write e.g. 'partition-id={{i}}'"
            )
        body = "\n".join(f"{toml_string(k)} = {v}" for k, v in pairs)
        try:
            return dict(tomllib.loads(body))
        except tomllib.TOMLDecodeError as err:
            raise DeploymentError(
                f"--node-config {template!r} is not 'key=value' pairs with TOML values "
                f'({err}): quote strings, e.g. data-root="/data/dev{{i}}"'
            ) from None

    return config


def write_app(folder: str | Path) -> Path:
    """Copy the Flower app radbo ships (:data:`APP_DIR`) to ``folder`` (made if missing) and
    return it: the folder ``flwr run`` takes, with nothing else in it (``flwr run`` bundles
    every ``.py``, ``.toml``, ``.md`` and ``.json`` file below the folder it is given)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(APP_DIR / "pyproject.toml", out / "pyproject.toml")
    return out


def check_flower() -> None:
    """Raise :class:`DeploymentError` when Flower is not installed where radbo runs."""
    if importlib.util.find_spec("flwr") is None:
        raise DeploymentError(
            f"Flower is not installed in the environment radbo runs in ({sys.executable}): "
            "pip install 'radbo[flower]'"
        )


@dataclass(frozen=True)
class LocalRun:
    """What :func:`deploy_local` did: how the run ended, where its files are, and the
    deployment (stopped; its process records remain: :meth:`LocalDeployment.leftovers`)."""

    status: RunStatus
    output: Path
    logs: Path
    deployment: LocalDeployment


def deploy_local(
    config_path: str | Path,
    output: str | Path | None = None,
    *,
    timeout_s: float = 1800.0,
    node_config: Callable[[int], Mapping[str, Scalar]] | None = None,
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = 120.0,
    echo: TextIO | None = None,
) -> LocalRun:
    """Run the radbo config at ``config_path`` on a local Flower deployment: a SuperLink and
    one SuperNode per client (``[fleet] num_clients``) on 127.0.0.1.

    ``output`` (default: the config's ``output_dir``) receives what ``radbo run`` writes
    (``results.json``, ``ledger.json``, checkpoints) and ``status.json``, plus ``app/`` (the
    Flower app, :func:`write_app`), ``nodes/client-<i>`` (each client's data, when
    ``[flower] data = "node"``) and ``logs/`` (one log per process, the node and run configs,
    the run's log). An output folder that already holds a deployment's files is refused.
    Node ``i`` gets ``node_config(i)``, by default ``partition-id = i`` and, with node data,
    ``data-root = "<output>/nodes/client-<i>"``. Every process gets ``env`` on top of this
    process's environment, with ``OMP_NUM_THREADS = 1`` unless set (one intra-op thread per
    process, as ``radbo run`` is matched bit for bit). The run is stopped after
    ``timeout_s``; every process started is stopped on return, error or interrupt.

    Raises :class:`DeploymentError` (Flower missing, an output folder in use, a daemon that
    does not start) and :class:`radbo.config.ConfigError` (the config)."""
    from radbo.config import load_config

    check_flower()
    if not timeout_s > 0:
        raise DeploymentError(f"timeout = {timeout_s:g} s: give a positive number of seconds")
    config_file = Path(config_path).resolve()
    config = load_config(config_file)
    out = Path(output if output is not None else config.output_dir).resolve()
    if out.exists() and not out.is_dir():
        raise DeploymentError(f"{out} is a file, not a folder: give an output folder")
    used = [name for name in _RUN_FILES if (out / name).exists()]
    if used:
        raise DeploymentError(
            f"{out} already holds a deployment's files ({', '.join(used)}): give a new "
            "output folder, or remove them"
        )
    app = write_app(out / "app")
    if node_config is None:
        node_config = _node_config(config, out / "nodes")
    deployment = LocalDeployment(
        app,
        config.fleet.num_clients,
        node_config,
        log_dir=out / "logs",
        env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})},
        start_timeout_s=start_timeout_s,
        echo=echo,
    )
    with deployment:
        status = deployment.run(
            {"radbo-config": str(config_file), "output-dir": str(out), "save": True},
            timeout_s=timeout_s,
        )
    return LocalRun(status, out, deployment.log_dir, deployment)


def _node_config(config: RunConfig, nodes: Path) -> Callable[[int], dict[str, Scalar]]:
    """Node ``i`` serves client ``i``; with ``[flower] data = "node"`` from the folder
    :func:`radbo.flower.write_node_data` writes for it below ``nodes``."""
    if config.flower.data != "node":
        return lambda i: {"partition-id": i}
    from radbo.flower.nodedata import write_node_data

    folders = [str(folder) for folder in write_node_data(config, nodes)]
    return lambda i: {"partition-id": i, "data-root": folders[i]}


def deploy_local_command(
    config_path: str,
    output: str | None,
    *,
    timeout_s: float,
    node_config: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``radbo flower deploy-local``: :func:`deploy_local` with the daemons' commands echoed
    on ``err``, and its exit code: 0 when the run completed, 1 when it did not (Flower or
    radbo says failed, or the timeout passed), 2 for a :class:`DeploymentError` (one line on
    ``err``), 128 + the signal for SIGINT, SIGTERM or SIGHUP (every process started is
    stopped first). A bad config raises :class:`radbo.config.ConfigError` for the caller to
    report."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    previous = {}

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        template = None if node_config is None else node_config_template(node_config)
        if template is not None:
            template(0)  # a malformed template is refused before anything starts
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, stop)
        done = deploy_local(
            config_path, output, timeout_s=timeout_s, node_config=template, echo=err
        )
    except DeploymentError as error:
        print(f"deploy error: {str(error).splitlines()[0]}", file=err)
        return 2
    except KeyboardInterrupt:
        print("deploy-local: interrupted; every process it started is stopped", file=err)
        return 128 + signal.SIGINT
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = done.status
    alive = done.deployment.leftovers()
    print(
        f"[deploy] processes: {dict(sorted(done.deployment.process_counts().items()))}; "
        f"still alive: {alive or 'none'}",
        file=err,
    )
    if status.completed:
        print(f"run {status.run_id} completed in {status.wall_s:.0f} s", file=out)
        print(f"results: {done.output / 'results.json'}", file=out)
        print(f"logs:    {done.logs}", file=out)
        return 0
    why = "timed out" if status.timed_out else status.status
    radbo = str((status.radbo or {}).get("error") or status.details).strip()
    radbo = radbo.splitlines()[0] if radbo else ""
    print(
        f"deploy error: run {status.run_id} did not complete ({why}{': ' if radbo else ''}"
        f"{radbo}); see {done.logs} and {done.output / 'status.json'}",
        file=err,
    )
    return 1
