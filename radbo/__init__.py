"""radbo: resource-aware federated bilevel optimization on heterogeneous edge devices.

The names below are imported on first use (PEP 562), so ``import radbo`` -- and importing a
light submodule such as :mod:`radbo.flower.worker` -- does not import torch; ``radbo.run``,
``from radbo import RABO`` and the like work as if imported eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radbo.lazy import lazy_attributes
from radbo.version import __version__

if TYPE_CHECKING:
    from radbo.aggregation import (
        CoverageMean,
        apply_step,
        coverage_weighted_mean,
    )
    from radbo.algorithms import (
        ALGORITHMS,
        RABO,
        AlgorithmConfig,
        FedMBO,
        FedMSA,
        RABOState,
        ShroFBO,
        SimFBO,
        SimFBOState,
        Wiring,
    )
    from radbo.client import (
        ClientBudget,
        ClientResult,
        ClientRuntime,
        ClientTask,
        ClientWork,
        Cohort,
        Phase,
        Prepared,
    )
    from radbo.config import (
        ConfigError,
        RunConfig,
        load_config,
        parse_config,
    )
    from radbo.cost import (
        LedgerEntry,
    )
    from radbo.devices import (
        BudgetPlanner,
        DeviceProfile,
        Fleet,
        load_catalog,
        probe_host,
    )
    from radbo.experiment import (
        Experiment,
        RunResult,
        build,
        fleet_table,
        run,
        run_seeds,
    )
    from radbo.export import (
        export_submodels,
    )
    from radbo.hypergrad import (
        ESTIMATORS,
        Autograd,
        Estimator,
        FiniteDifference,
        FirstOrder,
        HypergradResult,
        ImplicitCG,
        Neumann,
    )
    from radbo.masks import (
        StructurePlan,
        extract,
        scatter,
    )
    from radbo.masks.assigner import (
        SubmodelAssigner,
    )
    from radbo.masks.coverage_report import (
        coverage_stats,
    )
    from radbo.problem import (
        Batch,
        BilevelProblem,
        ClientData,
    )
    from radbo.registry import (
        Registry,
        Section,
    )
    from radbo.report import (
        compare,
        load_run,
    )
    from radbo.simulation import (
        BatchedBackend,
        DivergenceError,
        ProcessBackend,
        SequentialBackend,
        Simulation,
    )
    from radbo.tasks import (
        FeatureL2,
        HyperRepresentation,
    )

#: The module each public name lives in.
_LAZY: dict[str, str] = {
    "CoverageMean": "radbo.aggregation",
    "apply_step": "radbo.aggregation",
    "coverage_weighted_mean": "radbo.aggregation",
    "ALGORITHMS": "radbo.algorithms",
    "RABO": "radbo.algorithms",
    "AlgorithmConfig": "radbo.algorithms",
    "FedMBO": "radbo.algorithms",
    "FedMSA": "radbo.algorithms",
    "RABOState": "radbo.algorithms",
    "ShroFBO": "radbo.algorithms",
    "SimFBO": "radbo.algorithms",
    "SimFBOState": "radbo.algorithms",
    "Wiring": "radbo.algorithms",
    "ClientBudget": "radbo.client",
    "ClientResult": "radbo.client",
    "ClientRuntime": "radbo.client",
    "ClientTask": "radbo.client",
    "ClientWork": "radbo.client",
    "Cohort": "radbo.client",
    "Phase": "radbo.client",
    "Prepared": "radbo.client",
    "ConfigError": "radbo.config",
    "RunConfig": "radbo.config",
    "load_config": "radbo.config",
    "parse_config": "radbo.config",
    "LedgerEntry": "radbo.cost",
    "BudgetPlanner": "radbo.devices",
    "DeviceProfile": "radbo.devices",
    "Fleet": "radbo.devices",
    "load_catalog": "radbo.devices",
    "probe_host": "radbo.devices",
    "Experiment": "radbo.experiment",
    "RunResult": "radbo.experiment",
    "build": "radbo.experiment",
    "fleet_table": "radbo.experiment",
    "run": "radbo.experiment",
    "run_seeds": "radbo.experiment",
    "export_submodels": "radbo.export",
    "ESTIMATORS": "radbo.hypergrad",
    "Autograd": "radbo.hypergrad",
    "Estimator": "radbo.hypergrad",
    "FiniteDifference": "radbo.hypergrad",
    "FirstOrder": "radbo.hypergrad",
    "HypergradResult": "radbo.hypergrad",
    "ImplicitCG": "radbo.hypergrad",
    "Neumann": "radbo.hypergrad",
    "StructurePlan": "radbo.masks",
    "extract": "radbo.masks",
    "scatter": "radbo.masks",
    "SubmodelAssigner": "radbo.masks.assigner",
    "coverage_stats": "radbo.masks.coverage_report",
    "Batch": "radbo.problem",
    "BilevelProblem": "radbo.problem",
    "ClientData": "radbo.problem",
    "Registry": "radbo.registry",
    "Section": "radbo.registry",
    "compare": "radbo.report",
    "load_run": "radbo.report",
    "BatchedBackend": "radbo.simulation",
    "DivergenceError": "radbo.simulation",
    "ProcessBackend": "radbo.simulation",
    "SequentialBackend": "radbo.simulation",
    "Simulation": "radbo.simulation",
    "FeatureL2": "radbo.tasks",
    "HyperRepresentation": "radbo.tasks",
}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)

__all__ = [
    "ALGORITHMS",
    "ESTIMATORS",
    "RABO",
    "AlgorithmConfig",
    "Autograd",
    "Batch",
    "BatchedBackend",
    "BilevelProblem",
    "BudgetPlanner",
    "ClientBudget",
    "ClientData",
    "ClientResult",
    "ClientRuntime",
    "ClientTask",
    "ClientWork",
    "Cohort",
    "ConfigError",
    "CoverageMean",
    "DeviceProfile",
    "DivergenceError",
    "Estimator",
    "Experiment",
    "FeatureL2",
    "FedMBO",
    "FedMSA",
    "FiniteDifference",
    "FirstOrder",
    "Fleet",
    "HyperRepresentation",
    "HypergradResult",
    "ImplicitCG",
    "LedgerEntry",
    "Neumann",
    "Phase",
    "Prepared",
    "ProcessBackend",
    "RABOState",
    "Registry",
    "RunConfig",
    "RunResult",
    "Section",
    "SequentialBackend",
    "ShroFBO",
    "SimFBO",
    "SimFBOState",
    "Simulation",
    "StructurePlan",
    "SubmodelAssigner",
    "Wiring",
    "__version__",
    "apply_step",
    "build",
    "compare",
    "coverage_stats",
    "coverage_weighted_mean",
    "export_submodels",
    "extract",
    "fleet_table",
    "load_catalog",
    "load_config",
    "load_run",
    "parse_config",
    "probe_host",
    "run",
    "run_seeds",
    "scatter",
]
