"""radbo's model zoo. Every model declares which parameters are outer (x) and inner (y), and
registers its ``[model]`` config section in :data:`MODELS`."""

from radbo.models.base import MODELS, BatchNormConfig, BilevelModel, ModelConfig
from radbo.models.cnn import CNNConfig, SmallCNN
from radbo.models.cnn7 import CNN7, CNN7Config
from radbo.models.conv4 import Conv4, Conv4Config
from radbo.models.logistic import FeatureL2Logistic, LogisticConfig
from radbo.models.mlp import MLP, MLPConfig
from radbo.models.resnet import ResNet18, ResNet18Config
from radbo.models.resnet12 import ResNet12, ResNet12Config
from radbo.models.vs_mlp import VSMLP, VSMLPConfig, VSParameters
from radbo.models.vs_resnet import VSResNet18, VSResNet18Config

__all__ = [
    "CNN7",
    "MLP",
    "MODELS",
    "VSMLP",
    "VSParameters",
    "VSResNet18",
    "BatchNormConfig",
    "BilevelModel",
    "CNN7Config",
    "CNNConfig",
    "Conv4",
    "Conv4Config",
    "FeatureL2Logistic",
    "LogisticConfig",
    "MLPConfig",
    "ModelConfig",
    "ResNet12",
    "ResNet12Config",
    "ResNet18",
    "ResNet18Config",
    "SmallCNN",
    "VSMLPConfig",
    "VSResNet18Config",
]
