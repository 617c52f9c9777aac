"""The :class:`Dataset` container, the loaders of radbo's data sets and a stratified split.

All loaders run offline: :func:`load_digits` uses scikit-learn's bundled
handwritten digits (1797 real 8x8 images shipped inside the package), the others
read files the user already has (see :mod:`radbo.data.readers` for the formats).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from radbo.data.readers import read_cifar10, read_mnist, read_omniglot

__all__ = [
    "Dataset",
    "DatasetSummary",
    "load_digits",
    "load_mnist",
    "load_cifar10",
    "load_omniglot",
    "stratified_subset",
    "train_test_split",
]


@dataclass(frozen=True, eq=False)
class Dataset:
    """An in-memory labelled data set.

    Attributes:
        features: ``float32`` (or ``float64``) tensor of shape ``(N, *input_shape)``.
        labels: ``int64`` tensor of shape ``(N,)`` with values in ``[0, num_classes)``.
        num_classes: number of classes (labels need not all occur, e.g. in a subset).
        name: a human-readable name, e.g. ``"digits"`` or ``"digits/train"``.

    Example:
        >>> ds = Dataset(torch.zeros(4, 2), torch.tensor([0, 1, 1, 0]), 2, "toy")
        >>> len(ds), ds.input_shape, len(ds.subset(torch.tensor([1, 2])))
        (4, (2,), 2)
    """

    features: Tensor
    labels: Tensor
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.features, Tensor) or self.features.dtype not in (
            torch.float32,
            torch.float64,
        ):
            raise ValueError(
                f"Dataset {self.name!r}: features must be a float32 (or float64) tensor, got "
                f"{getattr(self.features, 'dtype', type(self.features).__name__)}; "
                "convert with .float()."
            )
        if self.features.ndim < 2:
            raise ValueError(
                f"Dataset {self.name!r}: features must have shape (N, *input_shape) with at "
                f"least 2 dimensions, got shape {tuple(self.features.shape)}; use "
                "features.unsqueeze(1) for one scalar feature per sample."
            )
        if not isinstance(self.labels, Tensor) or self.labels.dtype != torch.int64:
            raise ValueError(
                f"Dataset {self.name!r}: labels must be an int64 tensor, got "
                f"{getattr(self.labels, 'dtype', type(self.labels).__name__)}; "
                "convert with .long()."
            )
        if self.labels.ndim != 1 or self.labels.shape[0] != self.features.shape[0]:
            raise ValueError(
                f"Dataset {self.name!r}: labels must have shape (N,) = "
                f"({self.features.shape[0]},) to match features, got {tuple(self.labels.shape)}."
            )
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int):
            raise ValueError(
                f"Dataset {self.name!r}: num_classes must be an int, got {self.num_classes!r}."
            )
        if self.num_classes < 1:
            raise ValueError(
                f"Dataset {self.name!r}: num_classes must be at least 1, got {self.num_classes}."
            )
        if self.labels.numel() > 0:
            low, high = int(self.labels.min()), int(self.labels.max())
            if low < 0 or high >= self.num_classes:
                raise ValueError(
                    f"Dataset {self.name!r}: labels must lie in [0, {self.num_classes}), "
                    f"found values in [{low}, {high}]."
                )

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, ``features.shape[1:]``."""
        return tuple(self.features.shape[1:])

    def summary(self) -> DatasetSummary:
        """The set's labels, class count, sample shape and name, without its features."""
        return DatasetSummary(self.labels, self.num_classes, self.input_shape, self.name)

    def subset(self, indices: Tensor | Sequence[int]) -> Dataset:
        """Return the samples at ``indices`` (in the given order), same classes and name.

        Raises:
            ValueError: ``indices`` is not a 1-D integer index or is out of range.
        """
        index = (
            torch.as_tensor(indices, dtype=torch.int64)
            if not isinstance(indices, Tensor)
            else indices
        )
        if index.ndim != 1 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise ValueError(
                f"Dataset {self.name!r}: subset indices must be a 1-D integer tensor, got "
                f"dtype {index.dtype} and shape {tuple(index.shape)}."
            )
        index = index.to(dtype=torch.int64, device=self.labels.device)
        if index.numel() > 0 and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            raise ValueError(
                f"Dataset {self.name!r}: subset indices must lie in [0, {len(self)}), found "
                f"values in [{int(index.min())}, {int(index.max())}]."
            )
        return Dataset(self.features[index], self.labels[index], self.num_classes, self.name)


@dataclass(frozen=True, eq=False)
class DatasetSummary:
    """What a task's build reads of the whole training set: its labels, class count, sample
    shape and name, but no features (tasks such as ``vs_loss`` weigh classes by the training
    set's label frequencies). A Flower node, which holds only its own client's examples, makes
    one from the label counts its node data records (:meth:`from_label_counts`).

    >>> s = DatasetSummary.from_label_counts([2, 0, 1], (4,), "toy")
    >>> s.labels.tolist(), s.num_classes
    ([0, 0, 2], 3)
    """

    labels: Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    name: str

    @classmethod
    def from_label_counts(
        cls, counts: Sequence[int], input_shape: tuple[int, ...], name: str
    ) -> DatasetSummary:
        """The summary of a set holding ``counts[k]`` examples of class ``k``, sorted by class
        (the order of the labels does not matter to a task's build)."""
        per_class = torch.tensor(list(counts), dtype=torch.int64)
        labels = torch.repeat_interleave(torch.arange(len(counts)), per_class)
        return cls(labels, len(counts), tuple(input_shape), name)


def _as_dataset(images: np.ndarray, labels: np.ndarray, num_classes: int, name: str) -> Dataset:
    """Scale ``uint8`` pixels to ``[0, 1]`` and wrap them in a :class:`Dataset`."""
    features = torch.from_numpy(images.astype(np.float32) / np.float32(255.0))
    return Dataset(features, torch.from_numpy(labels.astype(np.int64)), num_classes, name)


def load_digits(*, flatten: bool = True) -> Dataset:
    """scikit-learn's bundled handwritten digits (UCI optical digits test set).

    1797 real 8x8 grayscale images of the digits 0-9 shipped with scikit-learn, so
    nothing is downloaded. Pixel counts 0-16 are divided by 16 into ``[0, 1]``.

    Args:
        flatten: ``True`` (default) gives features ``(1797, 64)``; ``False`` gives
            ``(1797, 1, 8, 8)`` for convolutional models.

    Example:
        >>> ds = load_digits()
        >>> len(ds), ds.input_shape, ds.num_classes
        (1797, (64,), 10)
    """
    from sklearn.datasets import load_digits as sklearn_load_digits

    bunch = sklearn_load_digits()
    features = torch.as_tensor(np.asarray(bunch.data, dtype=np.float32) / np.float32(16.0))
    if not flatten:
        features = features.reshape(-1, 1, 8, 8)
    labels = torch.as_tensor(np.asarray(bunch.target, dtype=np.int64))
    return Dataset(features, labels, 10, "digits")


def load_mnist(root: str | Path, *, train: bool = True, flatten: bool = True) -> Dataset:
    """MNIST from the IDX files in ``root`` (see :func:`radbo.data.readers.read_mnist`).

    Pixels are scaled by 1/255 into ``[0, 1]``; ``flatten=True`` (default) gives
    features ``(N, 784)``, otherwise ``(N, 1, 28, 28)``. Name ``"mnist/train"`` or
    ``"mnist/test"``.
    """
    images, labels = read_mnist(root, train=train)
    images = images.reshape(images.shape[0], -1) if flatten else images[:, None]
    return _as_dataset(images, labels, 10, f"mnist/{'train' if train else 'test'}")


def load_cifar10(root: str | Path, *, train: bool = True) -> Dataset:
    """CIFAR-10 from the binary batches in ``root`` or ``root/cifar-10-batches-bin``.

    ``train=True`` reads ``data_batch_1.bin`` ... ``data_batch_5.bin``, otherwise
    ``test_batch.bin``. Features ``(N, 3, 32, 32)`` (channel-first, as stored) scaled
    by 1/255. Name ``"cifar10/train"`` or ``"cifar10/test"``.
    """
    images, labels = read_cifar10(root, train=train)
    return _as_dataset(images, labels, 10, f"cifar10/{'train' if train else 'test'}")


def load_omniglot(root: str | Path, *, image_size: int = 28) -> Dataset:
    """Omniglot characters from ``root/<alphabet>/<character>/*.png``.

    Every character is one class, numbered in sorted path order; images are
    grayscale, resized to ``image_size`` (default 28) when needed, scaled by 1/255
    (white background = 1, strokes near 0) and shaped ``(N, 1, s, s)``.
    See :func:`radbo.data.readers.read_omniglot`.
    """
    images, labels, class_names = read_omniglot(root, image_size=image_size)
    return _as_dataset(images[:, None], labels, len(class_names), "omniglot")


def _test_counts(class_sizes: Tensor, total: int) -> Tensor:
    """Split ``total`` test samples over classes by largest remainder.

    Each class gets ``floor(q_c)`` or ``ceil(q_c)`` samples, ``q_c`` its exact
    proportional quota, and the counts sum to ``total``; ties go to lower classes.
    """
    sizes = class_sizes.to(torch.float64)
    quotas = sizes * total / sizes.sum()
    counts = quotas.floor().to(torch.int64)
    remainder = quotas - counts
    missing = total - int(counts.sum())
    order = torch.argsort(-remainder, stable=True)
    counts[order[:missing]] += 1
    return counts


def _stratified_pick(labels: Tensor, total: int, generator: torch.Generator) -> Tensor:
    """``total`` indices drawn at random, each class contributing its largest-remainder share
    (see :func:`_test_counts`); grouped by class, in drawing order within a class."""
    classes, class_sizes = torch.unique(labels, return_counts=True)
    counts = _test_counts(class_sizes, total)
    chosen = []
    for cls, count in zip(classes.tolist(), counts.tolist(), strict=True):
        members = torch.nonzero(labels == cls).flatten()
        order = torch.randperm(members.numel(), generator=generator)
        chosen.append(members[order[:count]])
    return torch.cat(chosen)


def stratified_subset(ds: Dataset, size: int, generator: torch.Generator) -> Dataset:
    """``size`` samples of ``ds`` drawn at random, deterministically given ``generator``.

    Every class contributes its proportional share (largest-remainder rounding, as in
    :func:`train_test_split`); the subset keeps the original sample order, the classes and the
    name. When ``size >= len(ds)`` the whole of ``ds`` is returned.

    >>> ds = Dataset(torch.zeros(6, 1), torch.tensor([0, 0, 0, 0, 1, 1]), 2, "toy")
    >>> sorted(stratified_subset(ds, 3, torch.Generator().manual_seed(0)).labels.tolist())
    [0, 0, 1]

    Raises:
        ValueError: ``size`` is not a positive integer.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"stratified_subset: size must be a positive integer, got {size!r}.")
    if size >= len(ds):
        return ds
    index = _stratified_pick(ds.labels.cpu(), size, generator)
    return ds.subset(torch.sort(index).values)


def train_test_split(
    ds: Dataset, test_fraction: float, generator: torch.Generator, *, stratify: bool = True
) -> tuple[Dataset, Dataset]:
    """Split ``ds`` into ``(train, test)`` at random, deterministically given ``generator``.

    The test part holds ``round(test_fraction * N)`` samples, clamped to
    ``[1, N - 1]`` so that both parts are non-empty. With ``stratify=True``
    (default) every class contributes its proportional share (largest-remainder
    rounding: each class's test count is within one sample of
    ``test_fraction * N_c``). Both parts keep the original sample order and are
    named ``"<name>/train"`` and ``"<name>/test"``.

    Raises:
        ValueError: ``test_fraction`` is not in ``(0, 1)`` or ``ds`` has fewer than
            2 samples.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"train_test_split: test_fraction must lie strictly between 0 and 1, "
            f"got {test_fraction}."
        )
    n = len(ds)
    if n < 2:
        raise ValueError(
            f"train_test_split: data set {ds.name!r} has {n} sample(s); at least 2 are needed "
            "for a non-empty train and test part."
        )
    n_test = min(max(round(test_fraction * n), 1), n - 1)
    if stratify:
        test_index = _stratified_pick(ds.labels.cpu(), n_test, generator)
    else:
        test_index = torch.randperm(n, generator=generator)[:n_test]
    is_test = torch.zeros(n, dtype=torch.bool)
    is_test[test_index] = True
    train_index = torch.nonzero(~is_test).flatten()
    test_index = torch.nonzero(is_test).flatten()
    train, test = ds.subset(train_index), ds.subset(test_index)
    return (
        Dataset(train.features, train.labels, ds.num_classes, f"{ds.name}/train"),
        Dataset(test.features, test.labels, ds.num_classes, f"{ds.name}/test"),
    )
