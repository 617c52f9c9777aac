"""radbo: resource-aware federated bilevel optimization on heterogeneous edge devices."""

from radbo.aggregation import CoverageMean, apply_step, coverage_stats, coverage_weighted_mean
from radbo.algorithms import (
    RABO,
    FedMBO,
    FedMSA,
    RABOState,
    ShroFBO,
    SimFBO,
    SimFBOState,
)
from radbo.config import ConfigError, RunConfig, load_config, parse_config
from radbo.cost import LedgerEntry
from radbo.devices import BudgetPlanner, DeviceProfile, Fleet, load_catalog, probe_host
from radbo.experiment import Experiment, RunResult, build, fleet_table, run
from radbo.export import export_submodels
from radbo.hypergrad import (
    AutogradProducts,
    FiniteDifference,
    FiniteDifferenceProducts,
    FirstOrder,
    HypergradEstimator,
    HypergradResult,
    ImplicitCG,
    Neumann,
)
from radbo.masks import StructurePlan, extract, scatter
from radbo.masks.assigner import SubmodelAssigner
from radbo.problem import Batch, BilevelProblem, ClientData
from radbo.report import compare, load_run
from radbo.simulation import ClientBudget, SequentialBackend, Simulation
from radbo.tasks import FeatureL2, HyperRepresentation

__version__ = "0.1.0"

__all__ = [
    "RABO",
    "AutogradProducts",
    "FiniteDifference",
    "FiniteDifferenceProducts",
    "FeatureL2",
    "FedMBO",
    "FedMSA",
    "FirstOrder",
    "ShroFBO",
    "SimFBO",
    "SimFBOState",
    "Batch",
    "BudgetPlanner",
    "DeviceProfile",
    "Fleet",
    "LedgerEntry",
    "BilevelProblem",
    "ClientBudget",
    "ClientData",
    "ConfigError",
    "CoverageMean",
    "Experiment",
    "HyperRepresentation",
    "HypergradEstimator",
    "HypergradResult",
    "ImplicitCG",
    "Neumann",
    "RABOState",
    "RunConfig",
    "RunResult",
    "SequentialBackend",
    "Simulation",
    "StructurePlan",
    "SubmodelAssigner",
    "__version__",
    "apply_step",
    "build",
    "compare",
    "export_submodels",
    "load_run",
    "coverage_stats",
    "coverage_weighted_mean",
    "extract",
    "fleet_table",
    "load_catalog",
    "probe_host",
    "load_config",
    "parse_config",
    "run",
    "scatter",
]
