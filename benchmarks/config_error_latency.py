"""How long ``radbo run`` takes to report a bad config: a fresh ``python -m radbo run`` on a
config with one typo'd value (``[algorithm] inner_lr = -1``) and on a file that is not TOML
(``rounds = = 3``), median of 5 runs each, wall-clock seconds from process start to exit (exit
code 2, one line on stderr). Beside them, the same for ``python -c "import torch"`` and for a
bare ``python -c pass``: what the error's latency is made of.

    .venv/bin/python benchmarks/config_error_latency.py

The acceptance bound of issue 15 is 3 s on an idle machine. Most of the time is importing
torch: the config classes live beside the code they configure (an algorithm's settings in the
algorithm's file), which imports torch. A file that cannot be read or parsed is refused before
that (``radbo.tomlfile``: the command line imports no torch until the file is a TOML document).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = 5


def _median_seconds(argv: list[str], expect: int) -> float:
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != expect:
            raise SystemExit(f"{argv} exited {done.returncode}, expected {expect}: {done.stderr}")
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        bad = Path(folder) / "bad.toml"
        bad.write_text("[algorithm]\ninner_lr = -1.0\n")
        error = subprocess.run(
            [sys.executable, "-m", "radbo", "run", str(bad)], capture_output=True, text=True
        ).stderr.strip()
        radbo = _median_seconds([sys.executable, "-m", "radbo", "run", str(bad)], expect=2)
        broken = Path(folder) / "broken.toml"
        broken.write_text("rounds = = 3\n")
        syntax = _median_seconds([sys.executable, "-m", "radbo", "run", str(broken)], expect=2)
    torch = _median_seconds([sys.executable, "-c", "import torch"], expect=0)
    bare = _median_seconds([sys.executable, "-c", "pass"], expect=0)
    print(f"error printed: {error}")
    print(f"radbo run bad.toml (a bad value): {radbo:.2f} s (median of {RUNS})")
    print(f"radbo run broken.toml (not TOML): {syntax:.2f} s (median of {RUNS})")
    print(f"python -c 'import torch': {torch:.2f} s")
    print(f"python -c pass: {bare:.2f} s")


if __name__ == "__main__":
    main()
