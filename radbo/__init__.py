"""radbo: resource-aware federated bilevel optimization on heterogeneous edge devices."""

from radbo.aggregation import CoverageMean, apply_step, coverage_weighted_mean
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
from radbo.config import ConfigError, RunConfig, load_config, parse_config
from radbo.cost import LedgerEntry
from radbo.devices import BudgetPlanner, DeviceProfile, Fleet, load_catalog, probe_host
from radbo.experiment import Experiment, RunResult, build, fleet_table, run
from radbo.export import export_submodels
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
from radbo.masks import StructurePlan, extract, scatter
from radbo.masks.assigner import SubmodelAssigner
from radbo.masks.coverage_report import coverage_stats
from radbo.problem import Batch, BilevelProblem, ClientData
from radbo.registry import Registry, Section
from radbo.report import compare, load_run
from radbo.simulation import (
    BatchedBackend,
    DivergenceError,
    ProcessBackend,
    SequentialBackend,
    Simulation,
)
from radbo.tasks import FeatureL2, HyperRepresentation
from radbo.version import __version__

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
    "scatter",
]
