"""radbo's model zoo. Every model declares which parameters are outer (x) and inner (y)."""

from radbo.models.base import BilevelModel
from radbo.models.cnn import SmallCNN
from radbo.models.mlp import MLP

__all__ = ["MLP", "BilevelModel", "SmallCNN"]
