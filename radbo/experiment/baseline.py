"""The paired full-model run a savings report compares with (``[baseline]``)."""

from __future__ import annotations

from typing import Any

from radbo.algorithms import RABOConfig
from radbo.config import RunConfig

__all__ = ["baseline_config"]


def baseline_config(config: RunConfig) -> RunConfig:
    """The paired full-model run of ``config`` (see :class:`radbo.config.BaselineConfig`).

    ``fedmbo_style``: RABO's two-phase round with every client on the full model and a
    truncated Neumann hypergradient. ``fedmbo``: FedMBO with the run's T, step sizes, batch
    sizes and clipping. Any other algorithm gives its local steps (tau, K) as T
    (:meth:`radbo.algorithms.AlgorithmConfig.baseline_settings`).
    """
    data: dict[str, Any] = config.model_dump()
    algo = config.algorithm
    settings = algo.baseline_settings()
    clip = settings.pop("max_hypergrad_norm", None)
    baseline = config.baseline
    if baseline.algorithm == "fedmbo":
        data["algorithm"] = {
            "name": "fedmbo",
            **settings,
            "neumann_terms": baseline.terms,
            "eta": baseline.eta,
            "clients_per_phase": baseline.clients_per_phase,
            "max_hypergrad_norm": clip,
        }
        data.pop("estimator", None)  # FedMBO's own default products
    else:
        if isinstance(algo, RABOConfig):
            data["algorithm"] = {**data["algorithm"], "name": "rabo"}
        else:
            data["algorithm"] = {"name": "rabo", **settings, "max_hypergrad_norm": clip}
        data["estimator"] = {"name": "neumann", "terms": baseline.terms, "eta": baseline.eta}
    data["mask"] = {**data["mask"], "policy": "none"}
    data["fleet"] = {**data["fleet"], "capacities": [1.0], "local_steps": "fixed"}
    data["baseline"] = {"enabled": False}
    return RunConfig.model_validate(data)
