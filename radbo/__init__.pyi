"""radbo's public API, declared once: each name and the module it comes from.

Type checkers read this stub; at run time ``radbo/__init__.py`` hands it to
``lazy_loader.attach_stub``, which imports each name from its module on first use.
Write ``from .module import Name as Name`` (the ``as`` form re-exports the name).
"""

from .aggregation import (
    CoverageMean as CoverageMean,
    apply_step as apply_step,
    coverage_weighted_mean as coverage_weighted_mean,
)
from .algorithms import (
    ALGORITHMS as ALGORITHMS,
    RABO as RABO,
    RAFBO as RAFBO,
    AggITD as AggITD,
    AggITDConfig as AggITDConfig,
    AggITDState as AggITDState,
    AlgorithmConfig as AlgorithmConfig,
    FedAvg as FedAvg,
    FedAvgConfig as FedAvgConfig,
    FedAvgState as FedAvgState,
    FedMBO as FedMBO,
    FedMBOConfig as FedMBOConfig,
    FedMBOState as FedMBOState,
    FedMSA as FedMSA,
    FedMSAConfig as FedMSAConfig,
    FedMSAState as FedMSAState,
    FedNest as FedNest,
    FedNestConfig as FedNestConfig,
    FedNestState as FedNestState,
    FedSVRBGD as FedSVRBGD,
    FedSVRBGDConfig as FedSVRBGDConfig,
    FedSVRBGDState as FedSVRBGDState,
    LFedNest as LFedNest,
    LFedNestConfig as LFedNestConfig,
    MAML as MAML,
    MAMLConfig as MAMLConfig,
    ProtoNet as ProtoNet,
    ProtoNetConfig as ProtoNetConfig,
    RABOConfig as RABOConfig,
    RABOState as RABOState,
    RAFBOConfig as RAFBOConfig,
    ShroFBO as ShroFBO,
    ShroFBOConfig as ShroFBOConfig,
    SimFBO as SimFBO,
    SimFBOConfig as SimFBOConfig,
    SimFBOState as SimFBOState,
    Wiring as Wiring,
)
from .client import (
    ClientBudget as ClientBudget,
    ClientResult as ClientResult,
    ClientRuntime as ClientRuntime,
    ClientTask as ClientTask,
    ClientWork as ClientWork,
    Cohort as Cohort,
    Phase as Phase,
    Prepared as Prepared,
)
from .config import (
    ConfigError as ConfigError,
    RunConfig as RunConfig,
    load_config as load_config,
    parse_config as parse_config,
)
from .cost import (
    LedgerEntry as LedgerEntry,
)
from .devices import (
    BudgetPlanner as BudgetPlanner,
    DeviceProfile as DeviceProfile,
    Fleet as Fleet,
    load_catalog as load_catalog,
    probe_host as probe_host,
)
from .experiment import (
    Experiment as Experiment,
    RunResult as RunResult,
    build as build,
    fleet_table as fleet_table,
    run as run,
    run_seeds as run_seeds,
)
from .export import (
    export_submodels as export_submodels,
)
from .hypergrad import (
    ESTIMATORS as ESTIMATORS,
    Autograd as Autograd,
    Estimator as Estimator,
    FiniteDifference as FiniteDifference,
    FirstOrder as FirstOrder,
    HypergradResult as HypergradResult,
    ImplicitCG as ImplicitCG,
    Neumann as Neumann,
)
from .masks import (
    StructurePlan as StructurePlan,
    extract as extract,
    scatter as scatter,
)
from .masks.assigner import (
    SubmodelAssigner as SubmodelAssigner,
)
from .masks.coverage_report import (
    coverage_stats as coverage_stats,
)
from .problem import (
    Batch as Batch,
    BilevelProblem as BilevelProblem,
    ClientData as ClientData,
)
from .registry import (
    Registry as Registry,
    Section as Section,
)
from .report import (
    compare as compare,
    load_run as load_run,
)
from .simulation import (
    BACKENDS as BACKENDS,
    AutoBackend as AutoBackend,
    BatchedBackend as BatchedBackend,
    DivergenceError as DivergenceError,
    ProcessBackend as ProcessBackend,
    SequentialBackend as SequentialBackend,
    Simulation as Simulation,
)
from .tasks import (
    FeatureL2 as FeatureL2,
    HyperRepresentation as HyperRepresentation,
)
from .version import (
    __version__ as __version__,
)
