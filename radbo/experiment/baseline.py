"""The paired full-model run a savings report compares with (``[baseline]``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radbo.algorithms import RABOConfig
from radbo.config import BaselineConfig, RunConfig
from radbo.registry import Named

__all__ = ["BASELINES", "baseline_config"]

#: ``[baseline] algorithm``'s kinds: each turns the run's config data (``data``, changed in
#: place) into its baseline's, from the run's algorithm section, its baseline settings (without
#: the clipping) and the clipping.
Baseline = Callable[[dict[str, Any], RunConfig, dict[str, Any], Any], None]
BASELINES: Named[Baseline] = Named("baseline.algorithm")


def baseline_config(config: RunConfig) -> RunConfig:
    """The paired full-model run of ``config`` (see :class:`radbo.config.BaselineConfig`).

    ``fedmbo_style``: RABO's two-phase round with every client on the full model and a
    truncated Neumann hypergradient. ``fedmbo``: FedMBO with the run's T, step sizes, batch
    sizes and clipping. Any other algorithm gives its local steps (tau, K) as T
    (:meth:`radbo.algorithms.AlgorithmConfig.baseline_settings`).
    """
    data: dict[str, Any] = config.model_dump()
    settings = config.algorithm.baseline_settings()
    clip = settings.pop("max_hypergrad_norm", None)
    BASELINES[config.baseline.algorithm](data, config, settings, clip)
    data["mask"] = {**data["mask"], "policy": "none"}
    data["fleet"] = {**data["fleet"], "capacities": [1.0], "local_steps": "fixed"}
    data["baseline"] = {"enabled": False}
    return RunConfig.model_validate(data)


@BASELINES.register("fedmbo")
def _fedmbo(data: dict[str, Any], config: RunConfig, settings: dict[str, Any], clip: Any) -> None:
    baseline: BaselineConfig = config.baseline
    data["algorithm"] = {
        "name": "fedmbo",
        **settings,
        "neumann_terms": baseline.terms,
        "eta": baseline.eta,
        "clients_per_phase": baseline.clients_per_phase,
        "max_hypergrad_norm": clip,
    }
    data.pop("estimator", None)  # FedMBO's own default products


@BASELINES.register("fedmbo_style")
def _fedmbo_style(
    data: dict[str, Any], config: RunConfig, settings: dict[str, Any], clip: Any
) -> None:
    if isinstance(config.algorithm, RABOConfig):  # RABO or RAFBO: its own settings
        data["algorithm"] = {**data["algorithm"], "name": "rabo"}
    else:
        data["algorithm"] = {"name": "rabo", **settings, "max_hypergrad_norm": clip}
    baseline = config.baseline
    data["estimator"] = {"name": "neumann", "terms": baseline.terms, "eta": baseline.eta}
