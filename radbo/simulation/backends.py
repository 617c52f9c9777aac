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

from typing import Any, Protocol

from radbo.client import Backend
from radbo.registry import Named

__all__ = ["BACKENDS", "BackendKind"]


class BackendKind(Protocol):
    """A registered backend class: built from the ``[runtime]`` section."""

    @classmethod
    def from_runtime(cls, runtime: Any) -> Backend:
        """The backend for ``runtime`` (a :class:`radbo.config.RuntimeConfig`: its ``workers``
        and the like)."""
        ...


#: The backends ``[runtime] backend`` chooses from, by name.
BACKENDS: Named[type[BackendKind]] = Named("runtime.backend")
