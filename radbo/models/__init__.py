"""radbo's model zoo. Every model declares which parameters are outer (x) and inner (y)."""

from radbo.models.base import BilevelModel
from radbo.models.cnn import SmallCNN
from radbo.models.cnn7 import CNN7
from radbo.models.logistic import FeatureL2Logistic
from radbo.models.mlp import MLP
from radbo.models.resnet import ResNet18
from radbo.models.resnet12 import ResNet12
from radbo.models.vs_mlp import VSMLP

__all__ = [
    "CNN7",
    "MLP",
    "VSMLP",
    "FeatureL2Logistic",
    "BilevelModel",
    "ResNet12",
    "ResNet18",
    "SmallCNN",
]
