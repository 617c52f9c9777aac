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

__all__ = ["BACKENDS", "BackendKind", "gpu_refusal"]


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


#: The backends ``[runtime] backend`` chooses from, by name.
BACKENDS: Named[type[BackendKind]] = Named("runtime.backend")


def gpu_refusal(name: str) -> str | None:
    """Why the backend registered as ``name`` cannot run on a GPU, or ``None`` when it can."""
    refusal: str | None = getattr(BACKENDS[name], "gpu_refusal", None)
    return refusal
