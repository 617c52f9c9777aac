"""Data sets, client partitions and file readers for radbo (all offline).

* :mod:`radbo.data.datasets` -- the :class:`Dataset` container, :func:`load_digits`
  (scikit-learn's bundled digits, the embedded default), loaders for MNIST (IDX),
  CIFAR-10 (binary) and Omniglot (PNG folders) from a local directory, a stratified
  :func:`train_test_split` and a stratified :func:`stratified_subset`.
* :mod:`radbo.data.partition` -- iid, shards, Dirichlet and FedMSA q-dominant
  client partitions, :func:`split_indices` and :func:`label_histogram`.
* :mod:`radbo.data.imbalance` -- long-tailed subsets (:func:`long_tail_subset`, the
  exponential profile of Cao et al. 2019 / Kini et al. 2021).
* :mod:`radbo.data.readers` -- validating readers of the raw file formats (IDX, CIFAR-10
  binary, Omniglot PNG, LIBSVM text) and an IDX writer.
* :mod:`radbo.data.sources` -- the ``[data]`` section (digits, MNIST, CIFAR-10, Omniglot,
  LIBSVM) and :func:`write_digits_as_mnist`; the ``[partition]`` section (iid, classes,
  shards, dirichlet, q_dominant) lives in :mod:`radbo.data.partition`.
"""

from radbo.data.datasets import (
    Dataset,
    DatasetSummary,
    load_cifar10,
    load_digits,
    load_mnist,
    load_omniglot,
    stratified_subset,
    train_test_split,
)
from radbo.data.imbalance import long_tail_counts, long_tail_subset
from radbo.data.partition import (
    PARTITIONS,
    ClassesPartition,
    DirichletPartition,
    IIDPartition,
    PartitionConfig,
    QDominantPartition,
    ShardsPartition,
    label_histogram,
    partition_classes,
    partition_dirichlet,
    partition_iid,
    partition_q_dominant,
    partition_shards,
    split_indices,
)
from radbo.data.readers import (
    read_cifar10,
    read_idx,
    read_libsvm,
    read_mnist,
    read_omniglot,
    write_idx,
)
from radbo.data.sources import (
    DATA,
    CIFAR10Data,
    DataConfig,
    DigitsData,
    FileData,
    LibSVMData,
    MNISTData,
    OmniglotData,
    calibration_set,
    with_rotations,
    write_digits_as_mnist,
)

__all__ = [
    "DATA",
    "PARTITIONS",
    "CIFAR10Data",
    "ClassesPartition",
    "DataConfig",
    "Dataset",
    "DatasetSummary",
    "DigitsData",
    "DirichletPartition",
    "FileData",
    "IIDPartition",
    "LibSVMData",
    "MNISTData",
    "OmniglotData",
    "PartitionConfig",
    "QDominantPartition",
    "ShardsPartition",
    "calibration_set",
    "with_rotations",
    "label_histogram",
    "load_cifar10",
    "load_digits",
    "load_mnist",
    "load_omniglot",
    "long_tail_counts",
    "long_tail_subset",
    "partition_classes",
    "partition_dirichlet",
    "partition_iid",
    "partition_q_dominant",
    "partition_shards",
    "read_cifar10",
    "read_idx",
    "read_libsvm",
    "read_mnist",
    "read_omniglot",
    "split_indices",
    "stratified_subset",
    "train_test_split",
    "write_digits_as_mnist",
    "write_idx",
]
