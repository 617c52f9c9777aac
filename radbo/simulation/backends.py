"""The registered backends: ``[runtime] backend`` names one of them (:data:`BACKENDS`).

A backend (:class:`radbo.client.Backend`) runs a phase's client work. Adding one is its class,
with a :meth:`~BackendKind.from_runtime` constructor, and one decorator::

    @BACKENDS.register("threads")
    class ThreadBackend:
        @classmethod
        def from_runtime(cls, runtime):
            return cls(runtime.workers)

        def run(self, work, runtime, meter, tasks): ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from radbo.client import Backend
from radbo.registry import Named

__all__ = ["BACKENDS", "BackendKind", "ParallelBackend", "StatefulBackend", "gpu_refusal"]


class BackendKind(Protocol):
    """A registered backend class: built from the ``[runtime]`` section.

    A backend that cannot run with ``[runtime] device = "cuda"`` says why in a class attribute
    ``gpu_refusal`` (a sentence; absent or ``None``: it can), which the config check quotes.
    """

    @classmethod
    def from_runtime(cls, runtime: Any) -> Backend:
        """The backend for ``runtime`` (a :class:`radbo.config.RuntimeConfig`: its ``workers``
        and the like)."""
        ...


@runtime_checkable
class StatefulBackend(Protocol):
    """A backend with choices of its own that a resumed run must make again (the ``auto``
    backend's plan): the engine saves them with its checkpoint state and restores them."""

    def state_dict(self) -> dict[str, Any]:
        """The backend's state, JSON."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ``ValueError``, changing nothing, when it is
        not one."""
        ...


@runtime_checkable
class ParallelBackend(Protocol):
    """A backend that computes on several CPUs of this machine (the process backend's
    workers), idle while the server works: the engine lets the server's aggregation use
    ``server_threads`` intra-op threads (:func:`radbo.aggregation.aggregation_threads`, whose
    results do not depend on the count)."""

    @property
    def server_threads(self) -> int:
        """Threads the server's aggregation may use (>= 1)."""
        ...


#: The backends ``[runtime] backend`` chooses from, by name.
BACKENDS: Named[type[BackendKind]] = Named("runtime.backend")


def gpu_refusal(name: str) -> str | None:
    """Why the backend registered as ``name`` cannot run on a GPU, or ``None`` when it can."""
    refusal: str | None = getattr(BACKENDS[name], "gpu_refusal", None)
    return refusal
