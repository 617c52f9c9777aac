"""Tests of radbo.data: the Dataset container, loaders, readers and client partitions."""

from __future__ import annotations

import doctest
import gzip
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import radbo.data.datasets
import radbo.data.partition
from radbo.data import (
    Dataset,
    label_histogram,
    load_cifar10,
    load_digits,
    load_mnist,
    load_omniglot,
    partition_dirichlet,
    partition_iid,
    partition_q_dominant,
    partition_shards,
    read_idx,
    split_indices,
    train_test_split,
)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def balanced_labels(num_classes: int, per_class: int) -> torch.Tensor:
    return torch.arange(num_classes).repeat_interleave(per_class)


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_digits()


def assert_valid_partition(parts: list[torch.Tensor], num_samples: int, num_clients: int) -> None:
    """Disjoint, complete, non-empty, sorted int64 parts."""
    assert len(parts) == num_clients
    for part in parts:
        assert part.dtype == torch.int64 and part.ndim == 1
        assert part.numel() > 0
        assert torch.equal(part, torch.sort(part).values)
    everything = torch.cat(parts)
    assert everything.numel() == num_samples  # disjoint given the next line
    assert torch.equal(torch.sort(everything).values, torch.arange(num_samples))


# ----------------------------------------------------------------------------- Dataset


def test_dataset_len_shape_and_subset() -> None:
    features = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    ds = Dataset(features, torch.tensor([0, 2, 1, 2]), 3, "toy")

    sub = ds.subset(torch.tensor([3, 1]))

    assert len(ds) == 4 and ds.input_shape == (3,)
    assert torch.equal(sub.features, features[[3, 1]])
    assert sub.labels.tolist() == [2, 2] and sub.num_classes == 3 and sub.name == "toy"
    assert len(ds.subset([0])) == 1


@pytest.mark.parametrize(
    ("features", "labels", "num_classes", "message"),
    [
        (torch.zeros(3, 2, dtype=torch.float16), torch.zeros(3, dtype=torch.int64), 2, "float32"),
        (torch.zeros(3), torch.zeros(3, dtype=torch.int64), 2, "at least 2 dimensions"),
        (torch.zeros(3, 2), torch.zeros(3, dtype=torch.int32), 2, "int64"),
        (torch.zeros(3, 2), torch.zeros(4, dtype=torch.int64), 2, r"shape \(N,\)"),
        (torch.zeros(3, 2), torch.tensor([0, 1, 2]), 2, r"lie in \[0, 2\)"),
        (torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), 0, "at least 1"),
    ],
)
def test_dataset_rejects_bad_fields(
    features: torch.Tensor, labels: torch.Tensor, num_classes: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Dataset(features, labels, num_classes, "bad")


def test_dataset_subset_rejects_out_of_range() -> None:
    ds = Dataset(torch.zeros(3, 2), torch.zeros(3, dtype=torch.int64), 1, "toy")
    with pytest.raises(ValueError, match=r"lie in \[0, 3\)"):
        ds.subset(torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="1-D integer"):
        ds.subset(torch.tensor([0.0]))


# ----------------------------------------------------------------------------- digits


def test_load_digits_shape_classes_and_range(digits: Dataset) -> None:
    from sklearn.datasets import load_digits as sklearn_digits

    images = load_digits(flatten=False)

    assert len(digits) == 1797 and digits.num_classes == 10 and digits.name == "digits"
    assert digits.input_shape == (64,) and images.input_shape == (1, 8, 8)
    assert digits.features.dtype == torch.float32 and digits.labels.dtype == torch.int64
    assert float(digits.features.min()) == 0.0 and float(digits.features.max()) == 1.0
    assert torch.equal(digits.labels.unique(), torch.arange(10))
    expected = torch.from_numpy(sklearn_digits().data.astype(np.float32) / 16)
    assert torch.equal(digits.features, expected)
    assert torch.equal(images.features.reshape(1797, 64), digits.features)


def test_train_test_split_is_deterministic_and_seed_dependent(digits: Dataset) -> None:
    train_a, test_a = train_test_split(digits, 0.25, gen(1))
    train_b, test_b = train_test_split(digits, 0.25, gen(1))
    _, test_c = train_test_split(digits, 0.25, gen(2))

    assert torch.equal(test_a.features, test_b.features)
    assert torch.equal(train_a.labels, train_b.labels)
    assert not torch.equal(test_a.features, test_c.features)
    assert (train_a.name, test_a.name) == ("digits/train", "digits/test")


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.8])
def test_train_test_split_stratified_within_one_sample(digits: Dataset, fraction: float) -> None:
    train, test = train_test_split(digits, fraction, gen(0))

    total = torch.bincount(digits.labels, minlength=10)
    in_test = torch.bincount(test.labels, minlength=10)
    in_train = torch.bincount(train.labels, minlength=10)
    assert len(test) == round(fraction * 1797) and len(train) + len(test) == 1797
    assert torch.equal(in_test + in_train, total)
    assert torch.all((in_test.double() - fraction * total.double()).abs() < 1.0)


def test_train_test_split_unstratified_sizes_and_errors(digits: Dataset) -> None:
    train, test = train_test_split(digits, 0.3, gen(0), stratify=False)

    assert len(test) == round(0.3 * 1797) and len(train) == 1797 - len(test)
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            train_test_split(digits, bad, gen(0))
    with pytest.raises(ValueError, match="at least 2"):
        train_test_split(digits.subset([0]), 0.5, gen(0))


# ----------------------------------------------------------------------------- partitions

SCHEMES: dict[str, Callable[..., list[torch.Tensor]]] = {
    "iid": lambda labels, k, g: partition_iid(labels, k, g),
    "shards": lambda labels, k, g: partition_shards(labels, k, 2, g),
    "dirichlet": lambda labels, k, g: partition_dirichlet(labels, k, 0.3, g),
    "q_dominant": lambda labels, k, g: partition_q_dominant(labels, k, 0.5, g),
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
@pytest.mark.parametrize("num_clients", [1, 7, 20])
def test_partitions_are_valid_and_deterministic(
    digits: Dataset, scheme: str, num_clients: int
) -> None:
    partition = SCHEMES[scheme]

    first = partition(digits.labels, num_clients, gen(3))
    again = partition(digits.labels, num_clients, gen(3))
    other = partition(digits.labels, num_clients, gen(4))

    assert_valid_partition(first, len(digits), num_clients)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    if num_clients > 1:
        assert any(not torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_partition_iid_sizes_differ_by_at_most_one(digits: Dataset) -> None:
    parts = partition_iid(digits.labels, 10, gen(0))
    sizes = [p.numel() for p in parts]
    assert sizes == [180] * 7 + [179] * 3


@pytest.mark.parametrize(
    ("num_clients", "classes_per_client"), [(15, 2), (10, 3), (10, 1), (30, 10)]
)
def test_partition_shards_exact_classes_per_client_on_balanced_data(
    num_clients: int, classes_per_client: int
) -> None:
    labels = balanced_labels(10, 30)

    parts = partition_shards(labels, num_clients, classes_per_client, gen(5))

    assert_valid_partition(parts, labels.numel(), num_clients)
    histogram = label_histogram(labels, parts, 10)
    assert torch.all((histogram > 0).sum(dim=1) == classes_per_client)


def test_partition_shards_on_digits_is_label_skewed(digits: Dataset) -> None:
    parts = partition_shards(digits.labels, 20, 2, gen(0))
    distinct = (label_histogram(digits.labels, parts, 10) > 0).sum(dim=1)
    assert int(distinct.max()) <= 4  # two shards, each straddling at most two classes


def total_variation_to_global(labels: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    """Per client, half the L1 distance between its label distribution and the global one."""
    histogram = label_histogram(labels, parts, int(labels.max()) + 1).double()
    local = histogram / histogram.sum(dim=1, keepdim=True)
    overall = torch.bincount(labels).double() / labels.numel()
    return 0.5 * (local - overall).abs().sum(dim=1)


def test_partition_dirichlet_alpha_controls_label_skew(digits: Dataset) -> None:
    near_iid = partition_dirichlet(digits.labels, 10, 1000.0, gen(0))
    skewed = partition_dirichlet(digits.labels, 10, 0.1, gen(0))

    tv_near_iid = total_variation_to_global(digits.labels, near_iid)
    tv_skewed = total_variation_to_global(digits.labels, skewed)
    # statistical, not rounding: numpy's seeded Dirichlet draws and integer label counts are
    # the same on every CPU and kernel (measured 0.019 and 0.669 on default and AVX-512)
    assert float(tv_near_iid.max()) < 0.1
    assert float(tv_skewed.mean()) > 0.5


def test_partition_dirichlet_min_size_is_enforced(digits: Dataset) -> None:
    parts = partition_dirichlet(digits.labels, 30, 0.01, gen(0), min_size=25)
    assert_valid_partition(parts, len(digits), 30)
    assert min(p.numel() for p in parts) >= 25


@settings(max_examples=60, deadline=None)
@given(
    num_clients=st.integers(min_value=1, max_value=40),
    alpha=st.floats(min_value=1e-3, max_value=1e3),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_partition_dirichlet_property_valid(num_clients: int, alpha: float, seed: int) -> None:
    labels = torch.tensor([0] * 5 + [1] * 60 + [2] * 15 + [3] * 40 + [4] * 1)

    parts = partition_dirichlet(labels, num_clients, alpha, gen(seed))

    assert_valid_partition(parts, labels.numel(), num_clients)


def test_partition_q_dominant_hand_computed() -> None:
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])

    parts = partition_q_dominant(labels, 2, 0.5, gen(0))

    histogram = label_histogram(labels, parts, 2)
    assert [p.numel() for p in parts] == [4, 4]
    assert int(histogram[0, 0]) >= 2 and int(histogram[1, 1]) >= 2


@pytest.mark.parametrize("q", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("num_clients", [10, 20])
def test_partition_q_dominant_fraction_close_to_q(q: float, num_clients: int) -> None:
    labels = balanced_labels(10, 100)

    parts = partition_q_dominant(labels, num_clients, q, gen(1))

    assert_valid_partition(parts, labels.numel(), num_clients)
    histogram = label_histogram(labels, parts, 10).double()
    sizes = histogram.sum(dim=1)
    dominant = torch.arange(num_clients) % 10
    share = histogram[torch.arange(num_clients), dominant] / sizes
    assert torch.all(histogram[torch.arange(num_clients), dominant] >= round(q * sizes[0].item()))
    assert torch.all(histogram.argmax(dim=1) == dominant)
    # FedMSA fills the rest uniformly from all classes: expected share q + (1 - q) / C.
    # Statistical, not rounding: seeded integer draws, the same on every CPU and kernel
    # (measured deviations 0.000-0.019 over the six cases).
    assert abs(float(share.mean()) - (q + (1 - q) / 10)) < 0.03


def test_partition_q_dominant_extremes() -> None:
    labels = balanced_labels(5, 40)

    pure = partition_q_dominant(labels, 10, 1.0, gen(0))
    iid_like = partition_q_dominant(labels, 10, 0.0, gen(0))

    pure_histogram = label_histogram(labels, pure, 5)
    assert torch.all((pure_histogram > 0).sum(dim=1) == 1)
    assert torch.equal(pure_histogram.argmax(dim=1), torch.arange(10) % 5)
    assert float(total_variation_to_global(labels, iid_like).max()) < 0.5


def test_partition_q_dominant_small_dominant_class_is_shared() -> None:
    labels = torch.tensor([0] * 2 + [1] * 48)  # class 0 cannot give 2 clients 12 samples each

    parts = partition_q_dominant(labels, 4, 0.5, gen(0))

    assert_valid_partition(parts, 50, 4)
    histogram = label_histogram(labels, parts, 2)
    assert int(histogram[:, 0].sum()) == 2
    assert [p.numel() for p in parts] == [13, 13, 12, 12]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda y: partition_iid(y, 11, gen(0)), "at most 10 clients"),
        (lambda y: partition_iid(y, 0, gen(0)), "positive int"),
        (lambda y: partition_iid(y.float(), 2, gen(0)), "1-D integer"),
        (lambda y: partition_iid(y, 2, 0), "torch.Generator"),
        (lambda y: partition_shards(y, 2, 0, gen(0)), r"must be an int in \[1, 2\]"),
        (lambda y: partition_shards(y, 2, 3, gen(0)), r"must be an int in \[1, 2\]"),
        (lambda y: partition_shards(y, 6, 2, gen(0)), "12 shards, more than the 10 samples"),
        (lambda y: partition_dirichlet(y, 2, 0.0, gen(0)), "alpha must be a positive"),
        (lambda y: partition_dirichlet(y, 2, -1.0, gen(0)), "alpha must be a positive"),
        (lambda y: partition_dirichlet(y, 2, float("nan"), gen(0)), "alpha must be a positive"),
        (lambda y: partition_dirichlet(y, 2, 1.0, gen(0), min_size=0), "min_size must be"),
        (lambda y: partition_dirichlet(y, 3, 1.0, gen(0), min_size=4), "only 10"),
        (lambda y: partition_q_dominant(y, 2, 1.5, gen(0)), r"q must be a number in \[0, 1\]"),
        (lambda y: split_indices(y, 1.0, gen(0)), "strictly between 0 and 1"),
        (lambda y: label_histogram(y, [y], 1), r"lie in \[0, 1\)"),
    ],
)
def test_partition_errors_are_clear(call: Callable[[torch.Tensor], object], message: str) -> None:
    labels = torch.tensor([0, 1] * 5)
    with pytest.raises(ValueError, match=message):
        call(labels)


def test_split_indices_disjoint_nonempty_and_deterministic() -> None:
    indices = torch.tensor([3, 9, 14, 20, 21, 40, 41])

    first, second = split_indices(indices, 0.3, gen(0))
    again = split_indices(indices, 0.3, gen(0))
    tiny = split_indices(torch.tensor([5, 6]), 0.01, gen(0))
    big = split_indices(torch.tensor([5, 6]), 0.99, gen(0))

    assert (first.numel(), second.numel()) == (2, 5)
    assert torch.equal(torch.sort(torch.cat([first, second])).values, indices)
    assert torch.equal(first, again[0]) and torch.equal(second, again[1])
    assert torch.equal(first, torch.sort(first).values)
    assert (tiny[0].numel(), tiny[1].numel()) == (1, 1)
    assert (big[0].numel(), big[1].numel()) == (1, 1)
    assert [p.numel() for p in split_indices(torch.tensor([7]), 0.6, gen(0))] == [1, 0]


def test_label_histogram_hand_computed() -> None:
    labels = torch.tensor([2, 0, 2, 1, 2])
    parts = [torch.tensor([0, 2]), torch.tensor([1, 3, 4]), torch.tensor([], dtype=torch.int64)]

    histogram = label_histogram(labels, parts, 4)

    assert histogram.tolist() == [[0, 0, 2, 0], [1, 1, 1, 0], [0, 0, 0, 0]]
    assert histogram.dtype == torch.int64


# ----------------------------------------------------------------------------- MNIST IDX


def idx_bytes(array: np.ndarray, magic: int) -> bytes:
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", s) for s in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_mnist(root: Path, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    files = {
        f"{prefix}-images-idx3-ubyte": idx_bytes(images, 2051),
        f"{prefix}-labels-idx1-ubyte": idx_bytes(labels, 2049),
    }
    for name, content in files.items():
        if gz:
            with gzip.open(root / f"{name}.gz", "wb") as handle:
                handle.write(content)
        else:
            (root / name).write_bytes(content)


def random_mnist(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, size=n, dtype=np.uint8),
    )


@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_reads_what_was_written(tmp_path: Path, gz: bool) -> None:
    train_images, train_labels = random_mnist(6, seed=0)
    test_images, test_labels = random_mnist(3, seed=1)
    write_mnist(tmp_path, "train", train_images, train_labels, gz)
    write_mnist(tmp_path, "t10k", test_images, test_labels, gz)

    train = load_mnist(tmp_path)
    test = load_mnist(tmp_path, train=False, flatten=False)

    assert train.input_shape == (784,) and test.input_shape == (1, 28, 28)
    assert (train.name, test.name, train.num_classes) == ("mnist/train", "mnist/test", 10)
    expected = torch.from_numpy(train_images.reshape(6, 784).astype(np.float32) / 255)
    assert torch.equal(train.features, expected)
    assert torch.equal(test.features[:, 0], torch.from_numpy(test_images.astype(np.float32) / 255))
    assert train.labels.tolist() == train_labels.tolist()
    assert test.labels.tolist() == test_labels.tolist()


def test_read_idx_decodes_big_endian_int32(tmp_path: Path) -> None:
    array = np.array([[1, -2, 70000], [3, 2**31 - 1, -(2**31)]], dtype=np.int32)
    path = tmp_path / "ints.idx"
    path.write_bytes(idx_bytes(array, 0x00000C02))

    read = read_idx(path)

    assert read.dtype == np.int32 and np.array_equal(read, array)


def test_load_mnist_missing_files_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte is missing; expected"):
        load_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "nowhere")


def test_load_mnist_bad_magic_is_rejected(tmp_path: Path) -> None:
    images, labels = random_mnist(2, seed=0)
    write_mnist(tmp_path, "train", images, labels, gz=False)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(idx_bytes(images, 2049))

    with pytest.raises(ValueError, match="magic number 2049; expected 2051"):
        load_mnist(tmp_path)


def test_load_mnist_truncated_file_is_rejected(tmp_path: Path) -> None:
    images, labels = random_mnist(3, seed=0)
    write_mnist(tmp_path, "train", images, labels, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])

    with pytest.raises(ValueError, match=r"truncated.*\(3, 28, 28\)"):
        load_mnist(tmp_path)


def test_load_mnist_count_mismatch_and_corrupt_gzip(tmp_path: Path) -> None:
    images, labels = random_mnist(3, seed=0)
    write_mnist(tmp_path / "mismatch", "train", images, labels[:2], gz=False)
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "train-images-idx3-ubyte.gz").write_bytes(b"not gzip at all")
    (tmp_path / "gz" / "train-labels-idx1-ubyte").write_bytes(idx_bytes(labels, 2049))

    with pytest.raises(ValueError, match="3 images but .* 2 labels"):
        load_mnist(tmp_path / "mismatch")
    with pytest.raises(ValueError, match="gzip"):
        load_mnist(tmp_path / "gz")


# ----------------------------------------------------------------------------- CIFAR-10


def write_cifar_batch(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    records = np.concatenate([labels[:, None], images.reshape(len(labels), -1)], axis=1)
    path.write_bytes(records.astype(np.uint8).tobytes())


def random_cifar(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8),
        rng.integers(0, 10, size=n, dtype=np.uint8),
    )


@pytest.fixture()
def cifar_root(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    folder = tmp_path / "cifar-10-batches-bin"
    folder.mkdir()
    train = [random_cifar(i + 1, seed=i) for i in range(5)]
    for i, (images, labels) in enumerate(train, start=1):
        write_cifar_batch(folder / f"data_batch_{i}.bin", images, labels)
    test_images, test_labels = random_cifar(2, seed=9)
    write_cifar_batch(folder / "test_batch.bin", test_images, test_labels)
    train_images = np.concatenate([t[0] for t in train])
    train_labels = np.concatenate([t[1] for t in train])
    return tmp_path, train_images, train_labels, test_images, test_labels


def test_load_cifar10_reads_what_was_written(cifar_root: tuple) -> None:
    root, train_images, train_labels, test_images, test_labels = cifar_root

    train = load_cifar10(root)
    test = load_cifar10(root / "cifar-10-batches-bin", train=False)

    assert len(train) == 15 and train.input_shape == (3, 32, 32)
    assert torch.equal(train.features, torch.from_numpy(train_images.astype(np.float32) / 255))
    assert train.labels.tolist() == train_labels.tolist()
    assert torch.equal(test.features, torch.from_numpy(test_images.astype(np.float32) / 255))
    assert test.labels.tolist() == test_labels.tolist()
    assert (train.name, test.name) == ("cifar10/train", "cifar10/test")


def test_load_cifar10_channel_layout_is_chw(tmp_path: Path) -> None:
    record = np.zeros(3073, dtype=np.uint8)
    record[0] = 7
    record[1 + 1024 + 32 * 2 + 5] = 255  # green channel, row 2, column 5
    (tmp_path / "test_batch.bin").write_bytes(record.tobytes())

    test = load_cifar10(tmp_path, train=False)

    assert test.labels.tolist() == [7]
    assert float(test.features[0, 1, 2, 5]) == 1.0 and float(test.features.sum()) == 1.0


def test_load_cifar10_truncated_record_is_rejected(cifar_root: tuple) -> None:
    root = cifar_root[0] / "cifar-10-batches-bin"
    path = root / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-1])

    with pytest.raises(ValueError, match=r"data_batch_3\.bin holds .* 3073-byte records"):
        load_cifar10(root)


def test_load_cifar10_missing_batch_and_bad_label(cifar_root: tuple) -> None:
    root = cifar_root[0] / "cifar-10-batches-bin"
    record = np.zeros(3073, dtype=np.uint8)
    record[0] = 42
    (root / "test_batch.bin").write_bytes(record.tobytes())
    (root / "data_batch_5.bin").unlink()

    with pytest.raises(FileNotFoundError, match=r"data_batch_5\.bin is missing"):
        load_cifar10(root)
    with pytest.raises(ValueError, match="label 42; expected 0-9"):
        load_cifar10(root, train=False)


# ----------------------------------------------------------------------------- Omniglot


def write_png(path: Path, pixels: np.ndarray, mode: str = "L") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(pixels)
    (image.convert(mode) if mode != "L" else image).save(path)


def test_load_omniglot_reads_what_was_written(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    written: dict[str, list[np.ndarray]] = {}
    # Created out of order to check that classes follow sorted path order.
    for alphabet in ("Zeta_script", "Alpha_script"):
        for character in ("character02", "character01"):
            for image in ("b.png", "a.png"):
                pixels = rng.integers(0, 256, size=(6, 6), dtype=np.uint8)
                write_png(tmp_path / alphabet / character / image, pixels)
                written.setdefault(f"{alphabet}/{character}", []).append(pixels)
    (tmp_path / ".DS_Store").write_bytes(b"ignored")
    (tmp_path / "Alpha_script" / "character01" / "notes.txt").write_text("ignored")

    ds = load_omniglot(tmp_path, image_size=6)

    assert len(ds) == 8 and ds.num_classes == 4 and ds.input_shape == (1, 6, 6)
    assert ds.labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    classes = sorted(written)
    for label, name in enumerate(classes):
        b_png, a_png = written[name]  # written as b then a; loaded in sorted order a, b
        expected = torch.from_numpy(np.stack([a_png, b_png]).astype(np.float32) / 255)
        assert torch.equal(ds.features[ds.labels == label, 0], expected)


def test_load_omniglot_resizes_binary_pngs(tmp_path: Path) -> None:
    white = np.full((105, 105), 255, dtype=np.uint8)
    stroke = white.copy()
    stroke[40:60, :] = 0
    write_png(tmp_path / "Latin" / "character01" / "01.png", white, mode="1")
    write_png(tmp_path / "Latin" / "character02" / "01.png", stroke, mode="1")

    ds = load_omniglot(tmp_path)

    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 2
    assert torch.all(ds.features[0] == 1.0)
    assert 0.0 <= float(ds.features.min()) and float(ds.features.max()) <= 1.0
    assert float(ds.features[1, 0, 14].max()) < 0.1  # the dark band survives resizing


def test_load_omniglot_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_omniglot(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no alphabet folders"):
        load_omniglot(tmp_path)
    (tmp_path / "Latin" / "character01").mkdir(parents=True)
    with pytest.raises(ValueError, match="holds no .png files"):
        load_omniglot(tmp_path)
    (tmp_path / "Latin" / "character01" / "01.png").write_bytes(b"\x89PNG broken")
    with pytest.raises(ValueError, match="could not be decoded"):
        load_omniglot(tmp_path)
    with pytest.raises(ValueError, match="image_size must be a positive"):
        load_omniglot(tmp_path, image_size=0)


# ----------------------------------------------------------------------------- doctests


@pytest.mark.parametrize("module", [radbo.data.datasets, radbo.data.partition])
def test_docstring_examples(module: object) -> None:
    result = doctest.testmod(module, extraglobs={"torch": torch}, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
