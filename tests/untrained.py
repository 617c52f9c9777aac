"""The bar an end-to-end run must clear: the test metrics of its untrained initial model."""

from radbo.config import RunConfig
from radbo.experiment import build


def untrained_metrics(config: RunConfig) -> dict[str, float]:
    """Test metrics of ``config``'s initial model (before round 0), keyed like ``run().final``
    (``test_accuracy``, ``test_loss``, ``test_balanced_accuracy``)."""
    exp = build(config)
    sim = exp.simulation
    assert sim.evaluate is not None
    metrics = sim.evaluate(sim.algorithm.model_state(exp.initial_state))
    return {f"test_{k}": v for k, v in metrics.items()}
