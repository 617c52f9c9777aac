"""Python API of ``radbo run``: build a simulation from a :class:`~radbo.config.RunConfig`,
run it, save it.

* :mod:`radbo.experiment.build` -- data, model, fleet, masks, algorithm, simulation;
* :mod:`radbo.experiment.clientside` -- the client side (model, algorithm, runtime) the
  simulation and a Flower node build alike;
* :mod:`radbo.experiment.evaluation` -- the test-set evaluator and static-BN calibration;
* :mod:`radbo.experiment.baseline` -- the paired full-model baseline run;
* :mod:`radbo.experiment.runner` -- the round loop, checkpoints and results;
* :mod:`radbo.experiment.lock` -- one writer per run folder (``radbo.lock``), path errors;
* :mod:`radbo.experiment.stop` -- SIGINT / SIGTERM: stop after the round, resumable;
* :mod:`radbo.experiment.logs` -- ``metrics.csv`` and TensorBoard scalars per round;
* :mod:`radbo.experiment.summary` -- the summary ``radbo run`` prints;
* :mod:`radbo.experiment.seeds` -- one config under several seeds, mean and 95 % interval.
"""

from radbo.experiment.baseline import baseline_config
from radbo.experiment.build import (
    Experiment,
    budget_planner,
    build,
    build_algorithm,
    build_fleet,
    build_model,
    build_policy,
    client_budgets,
    fleet_table,
    load_data,
    partition,
)
from radbo.experiment.evaluation import calibrate_batchnorm, calibration_inputs, make_evaluator
from radbo.experiment.lock import RunFolderBusyError, RunFolderError
from radbo.experiment.runner import (
    RunResult,
    check_run_folder,
    run,
    run_folder_contents,
    save_results,
)
from radbo.experiment.seeds import SeedsResult, run_seeds
from radbo.experiment.stop import RunAborted, RunStopped, stop_on_signals

__all__ = [
    "Experiment",
    "RunAborted",
    "RunFolderBusyError",
    "RunFolderError",
    "RunResult",
    "RunStopped",
    "SeedsResult",
    "baseline_config",
    "budget_planner",
    "build",
    "build_algorithm",
    "build_fleet",
    "build_model",
    "build_policy",
    "calibrate_batchnorm",
    "calibration_inputs",
    "check_run_folder",
    "client_budgets",
    "fleet_table",
    "load_data",
    "make_evaluator",
    "partition",
    "run",
    "run_folder_contents",
    "run_seeds",
    "save_results",
    "stop_on_signals",
]
