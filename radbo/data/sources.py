"""The ``[data]`` section: where a run's examples come from (all offline, never downloaded).

Also :func:`write_digits_as_mnist`, which writes scikit-learn's bundled digits as MNIST IDX
files, so that the MNIST path (``[data] name = "mnist"``) can be exercised without MNIST.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import AfterValidator, Field, model_validator

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
from radbo.data.readers import read_libsvm, write_idx
from radbo.randomness import Stream, generator
from radbo.registry import Registry, Section

__all__ = [
    "DATA",
    "CIFAR10Data",
    "DataConfig",
    "DigitsData",
    "FileData",
    "LibSVMData",
    "MNISTData",
    "OmniglotData",
    "with_rotations",
    "write_digits_as_mnist",
]

#: The registered ``[data]`` kinds.
DATA: Registry[DataConfig] = Registry("data", "name")


def _splittable(fraction: float) -> float:
    """Refuse an outer fraction so small that ``1 - fraction`` rounds to 1 (the inner share
    the partition splits by would be the whole client)."""
    if 1.0 - fraction >= 1.0:
        raise ValueError(f"{fraction!r} is too small: 1 - outer_fraction rounds to 1; use >= 1e-9")
    return fraction


_OuterFraction = Annotated[
    float,
    Field(gt=0, lt=1, description="share of each client's data used by the outer loss f_i"),
    AfterValidator(_splittable),
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
    dump_omits_defaults: ClassVar[tuple[str, ...]] = ("imbalance",)

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
        train, test = parts
        if train.input_shape != test.input_shape:  # e.g. an IDX header's rows or columns
            raise ValueError(
                f"{train.name} holds examples of shape {train.input_shape} but {test.name} "
                f"of shape {test.input_shape}; expected the same shape in both splits"
            )
        return train, test


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


@DATA.register
class LibSVMData(DataConfig):
    """A LIBSVM / SVMlight text file the user has (``<label> <index>:<value> ...``, 1-based
    indices; plain, ``.gz`` or ``.bz2``), e.g. a9a, w8a or covtype from the LIBSVM data sets
    page -- the data of the hyperparameter-optimization experiment of FedSVRBGD-FO (Zhang,
    Dhaipule, Tan, Ling and Gao, "Federated Stochastic Bilevel Optimization with Fully
    First-Order Gradients", IJCAI 2025, Sec. 5.1, ``papers/fedsbo_first_order.txt``), which
    is task ``feature_l2`` with model ``logistic``.

    Features are dense ``float64`` vectors of ``num_features`` entries (default: the largest
    index in ``path`` and ``test_path``; absent entries 0, values as written, not rescaled).
    Labels are integers (+1/-1, 0/1 or class numbers), numbered 0..C-1 in sorted order of
    the values found in both files (-1 -> 0, +1 -> 1). The test set is ``test_path`` when
    given, else a class-stratified ``test_fraction`` of ``path`` drawn from the run seed (the
    paper holds out 10 %: ``test_fraction = 0.1``).
    """

    name: Literal["libsvm"]
    path: str = Field(min_length=1, description="LIBSVM file of the training examples")
    test_path: str | None = Field(
        None, min_length=1, description="LIBSVM file of the test set (default: split path)"
    )
    test_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="held-out test share of path when there is no test_path (default 0.2)",
    )
    num_features: int | None = Field(
        None, ge=1, description="number of features; default: the largest index in the files"
    )

    #: the held-out share of ``path`` when neither ``test_path`` nor ``test_fraction`` is set
    default_test_fraction: ClassVar[float] = 0.2

    @model_validator(mode="after")
    def _one_test_set(self) -> LibSVMData:
        if self.test_path is not None and self.test_fraction is not None:
            raise ValueError(
                "give test_path (a test file) or test_fraction (a held-out share of path), not both"
            )
        return self

    def _read(self, field: Literal["path", "test_path"]) -> tuple[np.ndarray, np.ndarray]:
        path = str(getattr(self, field))
        # name the field (a run's error names only data.name); exists(), not is_file(): a
        # FIFO or device is refused by read_libsvm, by what it is, not reported missing
        if not Path(path).exists():
            raise FileNotFoundError(
                f"data.{field} = {path!r} is missing; expected a LIBSVM text file "
                "('<label> <index>:<value> ...' lines, 1-based indices)"
            )
        return read_libsvm(path, num_features=self.num_features)

    def splits(self, seed: int, *, flat: bool) -> tuple[Dataset, Dataset]:
        parts = [self._read("path")]
        if self.test_path is not None:
            parts.append(self._read("test_path"))
        width = max(features.shape[1] for features, _ in parts)
        classes = np.unique(np.concatenate([labels for _, labels in parts]))
        if classes.size < 2:
            raise ValueError(
                f"LIBSVM: {self.path} holds only label {classes[0]}; expected at least two classes"
            )
        name = Path(self.path).name
        datasets = [
            Dataset(
                torch.from_numpy(np.pad(features, ((0, 0), (0, width - features.shape[1])))),
                torch.from_numpy(np.searchsorted(classes, labels).astype(np.int64)),
                int(classes.size),
                name,
            )
            for features, labels in parts
        ]
        if self.test_path is None:
            fraction = self.test_fraction or self.default_test_fraction
            return train_test_split(datasets[0], fraction, generator(seed, Stream.SPLIT))
        test_name = Path(self.test_path).name
        train, test = datasets
        return (
            Dataset(train.features, train.labels, train.num_classes, f"{name}/train"),
            Dataset(test.features, test.labels, test.num_classes, f"{test_name}/test"),
        )


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


def write_digits_as_mnist(
    folder: str | Path,
    *,
    test_fraction: float = 0.2,
    seed: int = 0,
    image_size: int = 28,
    gz: bool = False,
) -> Path:
    """Write scikit-learn's bundled digits as the four MNIST IDX files in ``folder``.

    The images are those of ``[data] name = "digits"`` with ``image_size`` (default 28):
    the 8x8 digits upsampled bilinearly, then stored as ``uint8`` ``round(255 * pixel)``
    (ink bright on a dark background, as in MNIST). The train/test split is the digits
    split of run seed ``seed`` (stratified, ``test_fraction`` held out), so with the defaults
    ``train-images-idx3-ubyte`` holds 1438 and ``t10k-images-idx3-ubyte`` 359 images of
    28x28, and :func:`radbo.data.readers.read_mnist` / ``[data] name = "mnist"`` read them
    back: images within 0.5/255 of the digits data set's, labels equal.

    Args:
        folder: where to write (created if needed); files of the same names are replaced.
        test_fraction: share of the 1797 digits in the ``t10k`` files.
        seed: the run seed whose digits split is written.
        image_size: side of the written images (8 to 256).
        gz: write ``.gz`` files (as distributed) instead of plain ones (the readers take
            a plain file before a ``.gz`` one of the same name: use a fresh folder).

    Returns:
        ``folder`` as a :class:`~pathlib.Path`.
    """
    source = DigitsData(test_fraction=test_fraction, image_size=image_size)
    train, test = source.splits(seed, flat=False)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    for prefix, split in (("train", train), ("t10k", test)):
        pixels = (split.features[:, 0].double() * 255.0).round().clamp(0, 255)
        write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", pixels.numpy().astype(np.uint8))
        write_idx(
            folder / f"{prefix}-labels-idx1-ubyte{suffix}", split.labels.numpy().astype(np.uint8)
        )
    return folder
