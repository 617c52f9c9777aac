"""Python API of ``radbo run``: build a simulation from a :class:`~radbo.config.RunConfig`,
run it, save it.

* :mod:`radbo.experiment.build` -- data, model, fleet, masks, algorithm, simulation;
* :mod:`radbo.experiment.evaluation` -- the test-set evaluator and static-BN calibration;
* :mod:`radbo.experiment.baseline` -- the paired full-model baseline run;
* :mod:`radbo.experiment.runner` -- the round loop, checkpoints and results.
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
from radbo.experiment.runner import RunResult, run, save_results

__all__ = [
    "Experiment",
    "RunResult",
    "baseline_config",
    "budget_planner",
    "build",
    "build_algorithm",
    "build_fleet",
    "build_model",
    "build_policy",
    "calibrate_batchnorm",
    "calibration_inputs",
    "client_budgets",
    "fleet_table",
    "load_data",
    "make_evaluator",
    "partition",
    "run",
    "save_results",
]
