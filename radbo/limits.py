"""Caps on config values that would make a run hang, and ``radbo run --force`` to lift them.

Most bounds of a config field are physical (a probability lies in [0, 1], a step size is a
finite number > 0) and hold always. A few values are possible but, typed by mistake (an extra
``000``), would keep a run busy for hours or days before anything is reported: a run of
10^12 rounds, 10^9 local steps per round, a step size of 10^30 that diverges on every
problem. Those fields carry a *cap*: a value above it is refused with one line naming the
field, the limit and ``--force``, unless the caps are lifted: by ``radbo run --force`` (also
``radbo fleet`` / ``radbo export``), by ``parse_config(..., force=True)`` /
``load_config(..., force=True)``, or inside :func:`caps_lifted` (around :func:`radbo.run` too,
for the checks a run makes when it is built: the local steps a device budget gives with
``fleet.local_steps = "budget"``). The baseline run :func:`radbo.run` derives from a config
follows it past the caps.

=================================  ===========  =========================================
field                              cap          why
=================================  ===========  =========================================
``rounds``                         1,000,000    :data:`MAX_ROUNDS`
local / inner step counts, ...     10,000       :data:`MAX_STEPS` (per client and round)
``fleet.num_clients``              1,000,000    :data:`MAX_CLIENTS` (about 4.5 GB of tables)
step sizes (``*_lr``, ``eta``)     1,000        :data:`MAX_STEP_SIZE`
a device budget's local steps      1,000,000    :data:`MAX_BUDGET_STEPS` (checked at build)
=================================  ===========  =========================================

>>> from typing import Annotated
>>> from pydantic import BaseModel, ValidationError
>>> class Job(BaseModel):
...     rounds: Annotated[int, capped(100, "too long")] = 1
>>> try:
...     Job(rounds=1000)
... except ValidationError as err:
...     print(err.errors()[0]["msg"])
Value error, Input should be at most 100 (too long; radbo run --force lifts this cap)
>>> with caps_lifted():
...     Job(rounds=1000).rounds
1000
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Annotated, Any

from pydantic import AfterValidator, Field

__all__ = [
    "LATENCY_RUNS",
    "MAX_BATCH_SIZE",
    "MAX_BUDGET_STEPS",
    "MAX_CLIENTS",
    "MAX_CONFIG_BYTES",
    "MAX_ERROR_LINES",
    "MAX_ROUNDS",
    "MAX_STEPS",
    "MAX_STEP_SIZE",
    "BatchSize",
    "StepSize",
    "Steps",
    "caps_are_lifted",
    "caps_lifted",
    "capped",
]

#: Rounds of a run: at 0.1 s a round (a small model), a million rounds take more than a day.
MAX_ROUNDS = 1_000_000
#: Steps, iterations or terms a client runs per round (local SGD steps, lower-level rounds,
#: Neumann terms, CG iterations): the papers radbo implements use at most a few hundred.
MAX_STEPS = 10_000
#: Local steps a device budget may give a client per round (``fleet.local_steps = "budget"``:
#: the steps that fit ``deadline_s`` at the device's FLOP/s). The demo's MLP on the catalog's
#: laptop fits about 444,000 steps in the default 60 s; a deadline of 1e300 s fits 1e300.
MAX_BUDGET_STEPS = 1_000_000
#: Clients of a fleet: the per-client tables of 100,000 clients take about 445 MB
#: (``benchmarks/fleet_scale.py``), so a million about 4.5 GB.
MAX_CLIENTS = 1_000_000
#: A step size (learning rate, Neumann step): radbo's problems diverge far below it, and the
#: divergence guard, halving the step on each rollback, gives up long before 1e30 is tamed.
MAX_STEP_SIZE = 1_000.0

_LIFTED: ContextVar[bool] = ContextVar("radbo_caps_lifted", default=False)


def caps_are_lifted() -> bool:
    """Whether the caps are lifted here (inside :func:`caps_lifted`)."""
    return _LIFTED.get()


@contextmanager
def caps_lifted(lifted: bool = True) -> Iterator[None]:
    """Within the block, capped fields accept values above their cap (``lifted=False``:
    unchanged). Only the caps: physical bounds (finite, positive, ...) still hold."""
    if not lifted:
        yield
        return
    token = _LIFTED.set(True)
    try:
        yield
    finally:
        _LIFTED.reset(token)


def capped(limit: int | float, why: str) -> AfterValidator:
    """A pydantic validator (use in ``Annotated[...]``) refusing values above ``limit`` unless
    the caps are lifted; ``why`` says what a larger value would do."""
    text = f"{limit:,}" if isinstance(limit, int) else f"{limit:g}"

    def check(value: Any) -> Any:
        if value is not None and value > limit and not _LIFTED.get():
            raise ValueError(
                f"Input should be at most {text} ({why}; radbo run --force lifts this cap)"
            )
        return value

    return AfterValidator(check)


#: A count a client runs per round (local steps, lower-level rounds, Neumann terms, CG
#: iterations), capped at :data:`MAX_STEPS`; the field gives its own lower bound.
Steps = Annotated[int, capped(MAX_STEPS, "more would keep every round busy for hours")]
#: A step size (learning rate, Neumann step), capped at :data:`MAX_STEP_SIZE`; the field
#: gives its own lower bound and finiteness.
StepSize = Annotated[
    float, capped(MAX_STEP_SIZE, "a larger step diverges on the problems radbo runs")
]

#: The largest batch size: a hard bound, not a cap (a batch is clamped to a client's examples,
#: and a larger number overflows torch's 64-bit sizes on the way).
MAX_BATCH_SIZE = 1_000_000_000
#: A batch size, at most :data:`MAX_BATCH_SIZE` (always; ``--force`` does not lift it).
BatchSize = Annotated[int, Field(le=MAX_BATCH_SIZE)]


#: The largest config file radbo reads (bytes, checked from its size before it is read): the
#: shipped configs are a few kB; a 53 MB file of 3 million keys took 5 GB to validate.
MAX_CONFIG_BYTES = 1_000_000
#: Problems a config error lists at most, one line each, then one line "and K more problems".
MAX_ERROR_LINES = 20


#: Timed runs per latency figure of an exported program by default, after two untimed warm-up
#: runs (:func:`radbo.edge.measure_latency`; here, beside the other numeric defaults the
#: command line shows, so that building its parser imports no torch).
LATENCY_RUNS = 20
