"""radbo's model zoo. Every model declares which parameters are outer (x) and inner (y)."""

from radbo.models.base import BilevelModel
from radbo.models.cnn import SmallCNN
from radbo.models.mlp import MLP
from radbo.models.resnet import ResNet18

__all__ = ["MLP", "BilevelModel", "ResNet18", "SmallCNN"]
