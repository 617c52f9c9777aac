"""The ``[data]`` section: where a run's examples come from (all offline, never downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from radbo.data.datasets import (
    Dataset,
    load_cifar10,
    load_digits,
    load_mnist,
    load_omniglot,
    stratified_subset,
    train_test_split,
)
from radbo.data.imbalance import long_tail_subset
from radbo.randomness import Stream, generator
from radbo.registry import Registry, Section

__all__ = [
    "DATA",
    "CIFAR10Data",
    "DataConfig",
    "DigitsData",
    "FileData",
    "MNISTData",
    "OmniglotData",
    "with_rotations",
]

#: The registered ``[data]`` kinds.
DATA: Registry[DataConfig] = Registry("data", "name")

_OuterFraction = Annotated[
    float, Field(gt=0, lt=1, description="share of each client's data used by the outer loss f_i")
]
_Limit = Annotated[int, Field(ge=1, description="keep at most this many examples of the split")]
_Imbalance = Annotated[
    float,
    Field(
        ge=1,
        allow_inf_nan=False,
        description="long-tailed training set: class c of C keeps imbalance**(-c/(C-1)) of "
        "its examples (1 = unchanged)",
    ),
]


class DataConfig(Section):
    """Base of every ``[data]`` kind. Its dump leaves out ``imbalance`` at the default 1, so
    that configs without it dump (in ``results.json`` and checkpoints) as they did before it
    existed."""

    name: str
    outer_fraction: _OuterFraction = 0.3
    imbalance: _Imbalance = 1.0

    #: the test split holds other classes than the training split (labels are numbered
    #: independently in each), as Omniglot's background / evaluation alphabets
    disjoint_classes: ClassVar[bool] = False

    @model_serializer(mode="wrap")
    def _omit_default_imbalance(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and getattr(self, "imbalance", None) == 1.0:
            data.pop("imbalance", None)
        return data

    def load(self, seed: int, *, flat: bool) -> tuple[Dataset, Dataset]:
        """(training set, test set) as flat vectors (``flat``) or images ``(C, H, W)``; the
        training set long-tailed as ``imbalance`` asks (from the run seed), the test set as
        it is. ``OSError`` / ``ValueError`` for missing or damaged files."""
        train, test = self.splits(seed, flat=flat)
        if self.imbalance != 1:
            train = long_tail_subset(train, self.imbalance, generator(seed, Stream.LONG_TAIL))
        return train, test

    def splits(self, seed: int, *, flat: bool) -> tuple[Dataset, Dataset]:
        raise NotImplementedError


@DATA.register
class DigitsData(DataConfig):
    """scikit-learn's bundled handwritten digits (1797 8x8 images, no download), split by
    ``test_fraction`` (stratified, from the run seed). ``image_size`` upsamples the images
    (bilinear) for backbones that need larger ones (ResNet-12: at least 16x16)."""

    name: Literal["digits"] = "digits"
    test_fraction: float = Field(0.2, gt=0, lt=1, description="held-out test share")
    image_size: int | None = Field(
        None, ge=8, le=256, description="upsample the 8x8 images to this side (bilinear)"
    )

    def splits(self, seed: int, *, flat: bool) -> tuple[Dataset, Dataset]:
        data = load_digits(flatten=False)
        if self.image_size is not None and self.image_size != 8:
            images = F.interpolate(
                data.features, size=self.image_size, mode="bilinear", align_corners=False
            )
            data = Dataset(images, data.labels, data.num_classes, data.name)
        if flat:
            data = Dataset(data.features.flatten(1), data.labels, data.num_classes, data.name)
        return train_test_split(data, self.test_fraction, generator(seed, Stream.SPLIT))


class FileData(DataConfig):
    """A data set read from files the user already has in ``root`` (radbo never downloads).

    The official training split is the training data, the official test split the test set.
    ``limit_train`` / ``limit_test`` keep at most that many examples of each split: a
    class-stratified subset drawn from the run seed (all of the split when it is smaller).
    """

    root: str = Field(min_length=1, description="folder holding the data set's files")
    limit_train: _Limit | None = None
    limit_test: _Limit | None = None

    def read(self, train: bool, flat: bool) -> Dataset:
        raise NotImplementedError

    def splits(self, seed: int, *, flat: bool) -> tuple[Dataset, Dataset]:
        parts = []
        for i, limit in enumerate((self.limit_train, self.limit_test)):
            split = self.read(i == 0, flat)
            if len(split) == 0:
                raise ValueError(f"{split.name} is empty")
            if flat and split.features.ndim > 2:
                split = Dataset(
                    split.features.flatten(1), split.labels, split.num_classes, split.name
                )
            if limit is not None:
                split = stratified_subset(split, limit, generator(seed, Stream.SUBSET, i))
            parts.append(split)
        return parts[0], parts[1]


@DATA.register
class MNISTData(FileData):
    """MNIST from the IDX files in ``root`` (``train-images-idx3-ubyte`` ..., optionally
    ``.gz``; also torchvision's ``root/MNIST/raw``): 60000 train and 10000 test 1x28x28."""

    name: Literal["mnist"]

    def read(self, train: bool, flat: bool) -> Dataset:
        return load_mnist(self.root, train=train, flatten=flat)


@DATA.register
class CIFAR10Data(FileData):
    """CIFAR-10, binary version, in ``root`` or ``root/cifar-10-batches-bin``
    (``data_batch_1.bin`` ... ``data_batch_5.bin``, ``test_batch.bin``): 50000 train and
    10000 test 3x32x32."""

    name: Literal["cifar10"]

    def read(self, train: bool, flat: bool) -> Dataset:
        return load_cifar10(self.root, train=train)


@DATA.register
class OmniglotData(DataConfig):
    """Omniglot (Lake et al., 2015) from the extracted PNG folders in ``root``: the training
    set is ``images_background`` (964 characters of 30 alphabets), the test set
    ``images_evaluation`` (659 characters of 20 alphabets) -- the standard 30 / 20 alphabet
    split of the few-shot literature and of the RABO paper (Sec. V-A). Both folders may also
    sit in ``root/omniglot-py`` (torchvision's layout). Every character is a class; images are
    grayscale ``1 x image_size x image_size``. With ``rotations`` every character rotated by
    90, 180 and 270 degrees is a further class (the augmentation of MAML and ProtoNets)."""

    name: Literal["omniglot"]
    root: str = Field(min_length=1, description="folder holding images_background/evaluation")

    disjoint_classes: ClassVar[bool] = True
    image_size: int = Field(28, ge=4, le=105, description="side the images are resized to")
    rotations: bool = Field(False, description="rotated characters as extra classes")

    def _folder(self, which: str) -> Path:
        for base in (Path(self.root), Path(self.root) / "omniglot-py"):
            if (base / which).is_dir():
                return base / which
        raise FileNotFoundError(
            f"no {which} folder in {self.root} (or {Path(self.root) / 'omniglot-py'}); "
            "extract images_background.zip and images_evaluation.zip there"
        )

    def splits(self, seed: int, *, flat: bool) -> tuple[Dataset, Dataset]:
        parts = []
        for which in ("images_background", "images_evaluation"):
            data = load_omniglot(self._folder(which), image_size=self.image_size)
            if self.rotations:
                data = with_rotations(data)
            if flat:
                data = Dataset(data.features.flatten(1), data.labels, data.num_classes, data.name)
            parts.append(Dataset(data.features, data.labels, data.num_classes, f"omniglot/{which}"))
        return parts[0], parts[1]


def with_rotations(data: Dataset) -> Dataset:
    """``data`` and its images rotated by 90, 180 and 270 degrees, each rotation of a class a
    class of its own (class ``c`` rotated ``k`` quarter turns is class ``k * C + c``)."""
    images = [torch.rot90(data.features, k, dims=(-2, -1)) for k in range(4)]
    labels = [data.labels + k * data.num_classes for k in range(4)]
    return Dataset(torch.cat(images), torch.cat(labels), 4 * data.num_classes, data.name)


def calibration_set(train: Dataset, size: int, seed: int) -> torch.Tensor:
    """The server's calibration inputs for static BatchNorm: the first ``size`` examples of a
    seeded permutation of the training set."""
    pick = torch.randperm(len(train), generator=generator(seed, Stream.CALIBRATION))[:size]
    return train.features[pick]
