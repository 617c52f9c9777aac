"""The pfl-research side of ``benchmarks/vs_pfl.py``: runs inside the pfl virtual environment.

It rebuilds the setup of pfl-research's CIFAR-10 FedAvg benchmark
(``benchmarks/image_classification`` of github.com/apple/pfl-research, config
``configs/baseline.yaml``: ``dataset: cifar10_iid``, ``model_name: simple_cnn``,
``algorithm_name: fedavg``, ``mean_datapoints_per_user: 50`` with a ``constant`` size,
``cohort_size: 50``, ``local_num_epochs: 1``, ``local_batch_size: 10``,
``local_learning_rate: 0.1``, central SGD with ``learning_rate: 1.0``, ``weight_by_samples:
false``, no privacy mechanism) with pfl 0.6.0's public API, on the synthetic CIFAR-shaped
arrays that ``vs_pfl.py`` writes (``images.npy``: uint8 ``(N, 32, 32, 3)``, ``labels.npy``):

* the images are standardised per channel to float32, as pfl's CIFAR-10 loader does, and put on
  pfl's device up front (its benchmark passes ``numpy_to_tensor`` to the data set too); user
  ``u`` holds images ``50 u .. 50 u + 49`` (pfl's iid users are consecutive slices of a
  shuffled set; the synthetic set is random already);
* the model is pfl's ``simple_cnn`` for 32x32x3 inputs, written out here: NHWC -> NCHW, conv
  3x3 32, ReLU, conv 3x3 64, ReLU, max-pool 2, dropout 0.25, flatten, linear 12544 -> 128,
  ReLU, dropout 0.5, linear 128 -> 10, Glorot-uniform weights; mean cross-entropy loss;
* ``PyTorchModel`` (local optimizer ``torch.optim.SGD``, central ``SGD(lr=1.0)``),
  ``SimulatedBackend`` with ``WeightByUser``, ``FederatedAveraging``; users drawn at random.

Not timed, as the brief of the comparison asks: evaluation (``evaluation_frequency`` is
larger than the run, so only round 0, the warm-up, evaluates the cohort) and the central
evaluation / metrics-to-disk callbacks of pfl's script. A callback stamps the wall clock after
every central iteration; the script prints one JSON line with the seconds of every round and
the median of rounds 1.. (round 0 is the warm-up).

    .venv-pfl/bin/python benchmarks/pfl_side.py --data DIR --rounds 6 --per-round 50

The device is pfl's choice through ``PFL_PYTORCH_DEVICE`` (``cpu`` or ``cuda``), which
``vs_pfl.py`` sets; one intra-op thread (``torch.set_num_threads(1)``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.internal.ops.pytorch_ops import get_default_device, to_tensor
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel
from torch import nn
from torch.nn import functional as F


class SimpleCNN(nn.Module):
    """pfl-research's benchmark ``simple_cnn`` (two 3x3 convs, one max-pool, one hidden dense
    layer, two dropouts) for channel-last images, with the ``loss`` / ``metrics`` methods
    ``PyTorchModel`` calls."""

    def __init__(self, side: int = 32, channels: int = 3, classes: int = 10) -> None:
        super().__init__()
        pooled = (side - 4) // 2
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=3)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=3)
        self.drop1 = nn.Dropout(0.25)
        self.fc = nn.Linear(64 * pooled * pooled, 128)
        self.drop2 = nn.Dropout(0.5)
        self.out = nn.Linear(128, classes)
        for layer in (self.conv1, self.conv2, self.fc, self.out):
            nn.init.xavier_uniform_(layer.weight)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = images.permute(0, 3, 1, 2)  # NHWC -> NCHW, as pfl's Transpose2D layer
        h = F.relu(self.conv2(F.relu(self.conv1(h))))
        h = self.drop1(F.max_pool2d(h, 2)).flatten(1)
        return self.out(self.drop2(F.relu(self.fc(h))))

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.train(not eval)
        return F.cross_entropy(self(inputs), targets.long())

    @torch.no_grad()
    def metrics(self, inputs: torch.Tensor, targets: torch.Tensor, eval: bool = True) -> dict:
        self.train(not eval)
        logits = self(inputs)
        n = len(inputs)
        loss = F.cross_entropy(logits, targets.long(), reduction="sum").item()
        correct = (logits.argmax(-1) == targets.long()).sum().item()
        return {"loss": Weighted(loss, n), "accuracy": Weighted(correct, n)}


class RoundClock(TrainingProcessCallback):
    """Wall-clock stamps: one at the start of training and one after each central iteration."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def _stamp(self) -> None:
        if torch.cuda.is_available() and get_default_device().type == "cuda":
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())

    def on_train_begin(self, *, model):  # type: ignore[no-untyped-def]
        self._stamp()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # type: ignore[no-untyped-def]
        self._stamp()
        return False, Metrics()


def federated_data(folder: Path, per_user: int) -> FederatedDataset:
    """The users of the synthetic arrays: consecutive slices of ``per_user`` examples."""
    images = np.load(folder / "images.npy").astype(np.float32)
    labels = np.load(folder / "labels.npy").astype(np.int64)
    mean = images.mean(axis=(0, 1, 2), dtype="float64")
    std = images.std(axis=(0, 1, 2), dtype="float64")
    images = ((images - mean) / std).astype(np.float32)
    x, y = to_tensor(images), to_tensor(labels)
    users = {
        u: (x[s : s + per_user], y[s : s + per_user])
        for u, s in enumerate(range(0, len(images), per_user))
    }
    return FederatedDataset.from_slices(users, get_user_sampler("random", list(users)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="folder with images.npy and labels.npy")
    parser.add_argument("--rounds", type=int, default=6, help="central iterations (first: warm-up)")
    parser.add_argument("--per-round", type=int, default=50, help="cohort size")
    parser.add_argument("--per-user", type=int, default=50, help="examples per user")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    data = federated_data(Path(args.data), args.per_user)
    module = SimpleCNN()
    params = [p for p in module.parameters() if p.requires_grad]
    model = PyTorchModel(
        model=module,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(params, 1.0),
    )
    backend = SimulatedBackend(training_data=data, val_data=data, postprocessors=[WeightByUser()])
    clock = RoundClock()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=args.rounds,
            evaluation_frequency=args.rounds + 1,  # only round 0 (the warm-up) evaluates
            train_cohort_size=args.per_round,
            val_cohort_size=None,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=0.1, local_num_epochs=1, local_batch_size=10
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=10),
        callbacks=[clock],
    )
    seconds = [b - a for a, b in zip(clock.stamps[:-1], clock.stamps[1:], strict=True)]
    steady = seconds[1:] or seconds
    print(
        json.dumps(
            {
                "side": "pfl",
                "device": str(get_default_device()),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "pid": os.getpid(),
                "round_s": seconds,
                "s_per_round": statistics.median(steady),
            }
        )
    )


if __name__ == "__main__":
    main()
