"""Config-driven data sets (digits, MNIST, CIFAR-10) and models (mlp, cnn, cnn7, resnet12,
resnet18): validation, one-line errors, CLI exit codes, subsets and tiny end-to-end runs.

MNIST and CIFAR-10 are written in their real file formats (IDX, CIFAR binary batches) into
temporary folders with the helpers of ``tests/data/test_data.py``; nothing is downloaded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from radbo.cli import main
from radbo.config import ConfigError, RunConfig, parse_config
from radbo.experiment import build, build_model, load_data, run
from tests.data.test_data import random_cifar, random_mnist, write_cifar_batch, write_mnist

MNIST_TRAIN, MNIST_TEST = 60, 20
CIFAR_PER_BATCH, CIFAR_TEST = 12, 20  # 5 training batches: 60 training images


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only cost time on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def mnist_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mnist")
    write_mnist(root, "train", *random_mnist(MNIST_TRAIN, seed=0), gz=False)
    write_mnist(root, "t10k", *random_mnist(MNIST_TEST, seed=1), gz=True)
    return root


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    folder = root / "cifar-10-batches-bin"
    folder.mkdir()
    for i in range(1, 6):
        write_cifar_batch(folder / f"data_batch_{i}.bin", *random_cifar(CIFAR_PER_BATCH, seed=i))
    write_cifar_batch(folder / "test_batch.bin", *random_cifar(CIFAR_TEST, seed=9))
    return root


def tiny(data: dict, model: dict, **overrides: object) -> RunConfig:
    """A 2-round masked run (importance policy, capacities 1 and 1/2) sized for a few seconds."""
    config: dict = {
        "seed": 0,
        "rounds": 2,
        "eval_every": 1,
        "data": data,
        "model": model,
        "partition": {"kind": "iid"},
        "fleet": {"num_clients": 3, "capacities": [1.0, 0.5]},
        "mask": {"policy": "importance"},
        "algorithm": {"name": "rabo", "inner_steps": 2, "batch_size": 8, "outer_batch_size": 8},
        "estimator": {"name": "cg", "max_iter": 3},
    }
    config.update(overrides)
    return parse_config(config)


def one_line_config_error(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    return message


# ------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "data",
    [
        {"name": "mnist", "root": "/data/mnist"},
        {"name": "mnist", "root": "m", "outer_fraction": 0.4, "limit_train": 1, "limit_test": 5},
        {"name": "cifar10", "root": "/data/cifar", "limit_train": 5000},
    ],
)
def test_file_data_kinds_validate(data: dict) -> None:
    cfg = parse_config({"data": data})

    assert cfg.data.name == data["name"] and cfg.data.root == data["root"]
    assert cfg.data.outer_fraction == data.get("outer_fraction", 0.3)
    assert cfg.data.limit_train == data.get("limit_train")
    assert cfg.data.limit_test == data.get("limit_test")
    assert not hasattr(cfg.data, "test_fraction")


def test_digits_stays_the_default_data_and_takes_its_section_without_a_name() -> None:
    assert RunConfig().data.name == "digits"
    assert RunConfig().data.model_dump() == {
        "name": "digits",
        "test_fraction": 0.2,
        "outer_fraction": 0.3,
        "image_size": None,
    }

    cfg = parse_config({"data": {"test_fraction": 0.25}})

    assert cfg.data.name == "digits" and cfg.data.test_fraction == 0.25


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"name": "cnn7"}, {"channels": [6, 16], "hidden": [120, 84]}),
        ({"name": "cnn7", "channels": [2, 4], "hidden": [8, 8]}, {"channels": [2, 4]}),
        (
            {"name": "resnet12"},
            {"widths": [64, 160, 320, 640], "batchnorm": "aggregate", "calibration_samples": 512},
        ),
        (
            {"name": "resnet18", "widths": [4, 8, 8, 8], "batchnorm": "static"},
            {"widths": [4, 8, 8, 8], "batchnorm": "static"},
        ),
        ({"name": "resnet18"}, {"widths": [64, 128, 256, 512]}),
    ],
)
def test_new_model_kinds_validate_with_their_defaults(model: dict, expected: dict) -> None:
    cfg = parse_config({"model": model})

    dumped = cfg.model.model_dump()
    assert dumped["name"] == model["name"]
    for key, value in expected.items():
        assert dumped[key] == value, key


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"data": {"name": "mnist"}}, "config error: data.root = {...}: Field required"),
        (
            {"data": {"name": "mnist", "root": "m", "test_fraction": 0.2}},
            "config error: data.test_fraction = 0.2: unknown field",
        ),
        (
            {"data": {"name": "cifar10", "root": "c", "limit_train": 0}},
            "config error: data.limit_train = 0: Input should be greater than or equal to 1",
        ),
        (
            {"data": {"name": "mnist", "root": "m", "limit_test": 2.5}},
            "config error: data.limit_test = 2.5: Input should be a valid integer",
        ),
        (
            {"data": {"name": "cifar10", "root": ""}},
            "config error: data.root = '': String should have at least 1 character",
        ),
        (
            {"data": {"name": "svhn", "root": "s"}},
            "config error: data = {...}: Input tag 'svhn' found using 'name' does not match any "
            "of the expected tags: 'digits', 'mnist', 'cifar10'",
        ),
        (
            {"data": {"root": "m"}},  # no name: digits, which has no root
            "config error: data.root = 'm': unknown field",
        ),
        (
            {"data": {"name": "digits", "limit_train": 10}},
            "config error: data.limit_train = 10: unknown field",
        ),
        (
            {"model": {"name": "resnet18", "widths": [8, 8]}},
            "config error: model.widths = [8, 8]: List should have at least 4 items",
        ),
        (
            {"model": {"name": "resnet12", "widths": [0, 4, 4, 4]}},
            "config error: model.widths.0 = 0: Input should be greater than or equal to 1",
        ),
        (
            {"model": {"name": "cnn7", "channels": [6, 16, 32]}},
            "config error: model.channels = [6, 16, 32]: List should have at most 2 items",
        ),
        (
            {"model": {"name": "cnn7", "batchnorm": "static"}},  # CNN7 has no BatchNorm
            "config error: model.batchnorm = 'static': unknown field",
        ),
        (
            {"model": {"name": "resnet12", "batchnorm": "dynamic"}},
            "config error: model.batchnorm = 'dynamic': Input should be 'aggregate' or 'static'",
        ),
        (
            {"model": {"name": "resnet18", "calibration_samples": 0}},
            "config error: model.calibration_samples = 0: Input should be greater than or "
            "equal to 1",
        ),
        (
            {"model": {"name": "vgg"}},
            "config error: model = {...}: Input tag 'vgg' found using 'name' does not match any "
            "of the expected tags: 'cnn', 'cnn7', 'conv4', 'logistic', 'mlp', 'resnet18', 'resnet12', 'vs_mlp', 'vs_resnet18'",
        ),
    ],
)
def test_bad_data_and_model_values_give_one_line_naming_the_field(
    patch: dict, expected: str
) -> None:
    assert expected in one_line_config_error(patch)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"name": "cnn7"}, "model.name = 'cnn7': needs images of at least 16x16"),
        ({"name": "resnet12"}, "model.name = 'resnet12': needs images of at least 16x16"),
        ({"name": "resnet18"}, "model.name = 'resnet18': needs images of at least 9x9"),
    ],
)
def test_model_too_large_for_the_images_is_a_one_line_config_error(
    model: dict, expected: str
) -> None:
    cfg = parse_config({"model": model})  # digits: 1x8x8

    with pytest.raises(ConfigError) as err:
        build(cfg)

    message = str(err.value)
    assert message.startswith("config error: ") and expected in message
    assert "digits gives 1x8x8" in message and len(message.splitlines()) == 1


def test_conv_model_on_flat_inputs_is_a_config_error() -> None:
    cfg = parse_config({"model": {"name": "resnet18", "widths": [2, 2, 2, 2]}})

    with pytest.raises(ConfigError, match=r"needs square images \(C, S, S\).*\(64,\)"):
        build_model(cfg.model, (64,), 10, seed=0, dtype=torch.float32, data_name="digits")


# ------------------------------------------------------------------------ CLI errors
def write_config(path: Path, data_section: str, model_section: str = 'name = "mlp"') -> Path:
    path.write_text(
        f"rounds = 2\n\n[data]\n{data_section}\n\n[model]\n{model_section}\n",
        encoding="utf-8",
    )
    return path


def test_cli_missing_root_exits_2_with_one_line_naming_field_and_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-folder"
    path = write_config(tmp_path / "run.toml", f'name = "mnist"\nroot = "{missing.as_posix()}"')

    code = main(["run", str(path), "--quiet", "--output-dir", str(tmp_path / "out")])

    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"config error: data.root = '{missing.as_posix()}': MNIST: directory")
    assert "does not exist" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "keep", "missing"),
    [
        ("mnist", ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"), "t10k-images-idx3"),
        ("cifar10", tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test_batch.bin"),
    ],
)
def test_cli_missing_data_file_exits_2_naming_the_file(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    mnist_root: Path,
    cifar_root: Path,
    name: str,
    keep: tuple[str, ...],
    missing: str,
) -> None:
    source = mnist_root if name == "mnist" else cifar_root / "cifar-10-batches-bin"
    root = tmp_path / "partial"
    root.mkdir()
    for file in keep:  # the training files only
        (root / file).write_bytes((source / file).read_bytes())
    path = write_config(tmp_path / "run.toml", f'name = "{name}"\nroot = "{root.as_posix()}"')

    code = main(["run", str(path), "--quiet", "--output-dir", str(tmp_path / "out")])

    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"config error: data.root = '{root.as_posix()}': ")
    assert missing in err and "is missing" in err


def test_corrupt_data_file_is_a_one_line_config_error(tmp_path: Path, mnist_root: Path) -> None:
    root = tmp_path / "corrupt"
    root.mkdir()
    for file in mnist_root.iterdir():
        (root / file.name).write_bytes(file.read_bytes())
    images = root / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-5])
    cfg = parse_config({"data": {"name": "mnist", "root": str(root)}})

    with pytest.raises(ConfigError) as err:
        load_data(cfg)

    message = str(err.value)
    assert message.startswith("config error: data.root = ") and "is truncated" in message
    assert len(message.splitlines()) == 1


def test_cli_model_too_large_for_digits_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path / "run.toml", 'name = "digits"', 'name = "cnn7"')

    assert main(["run", str(path), "--quiet", "--output-dir", str(tmp_path / "out")]) == 2

    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.name = 'cnn7'" in err


# ------------------------------------------------------------------------ data loading
def test_mnist_uses_the_official_splits_shaped_for_the_model(mnist_root: Path) -> None:
    data = {"name": "mnist", "root": str(mnist_root)}

    flat_train, flat_test = load_data(parse_config({"data": data}))
    train, test = load_data(parse_config({"data": data, "model": {"name": "cnn7"}}))

    assert (len(flat_train), len(flat_test)) == (MNIST_TRAIN, MNIST_TEST)
    assert flat_train.input_shape == (784,) and train.input_shape == (1, 28, 28)
    images, labels = random_mnist(MNIST_TEST, seed=1)
    assert test.labels.tolist() == labels.tolist()
    assert torch.equal(test.features[:, 0], torch.from_numpy(images.astype(np.float32) / 255))
    assert torch.equal(flat_test.features, test.features.flatten(1))


def test_cifar10_gives_images_to_conv_models_and_flat_vectors_to_mlp(cifar_root: Path) -> None:
    data = {"name": "cifar10", "root": str(cifar_root)}

    train, test = load_data(parse_config({"data": data, "model": {"name": "resnet18"}}))
    flat_train, _ = load_data(parse_config({"data": data, "model": {"name": "mlp"}}))

    assert (len(train), len(test)) == (5 * CIFAR_PER_BATCH, CIFAR_TEST)
    assert train.input_shape == (3, 32, 32) and flat_train.input_shape == (3072,)
    assert torch.equal(flat_train.features, train.features.flatten(1))
    assert train.num_classes == 10


def test_limit_train_keeps_exactly_that_many_the_same_subset_for_the_same_seed(
    mnist_root: Path,
) -> None:
    def loaded(seed: int, **limits: int) -> tuple:
        data = {"name": "mnist", "root": str(mnist_root), **limits}
        return load_data(parse_config({"seed": seed, "data": data}))

    train, test = loaded(0, limit_train=25, limit_test=7)
    again, again_test = loaded(0, limit_train=25, limit_test=7)
    other, _ = loaded(1, limit_train=25, limit_test=7)
    full_train, full_test = loaded(0)

    assert (len(train), len(test)) == (25, 7)
    assert torch.equal(train.features, again.features) and torch.equal(train.labels, again.labels)
    assert torch.equal(test.features, again_test.features)
    assert not torch.equal(train.features, other.features)
    # a subset of the official split, stratified: each class within one of its share
    rows = {tuple(r.tolist()) for r in full_train.features}
    assert all(tuple(r.tolist()) in rows for r in train.features)
    full_counts = torch.bincount(full_train.labels, minlength=10).double()
    counts = torch.bincount(train.labels, minlength=10).double()
    assert torch.all((counts - full_counts * 25 / MNIST_TRAIN).abs() < 1)
    # the train limit does not move the test subset and vice versa
    assert torch.equal(loaded(0, limit_test=7)[1].features, test.features)
    assert torch.equal(loaded(0, limit_train=25)[0].features, train.features)
    assert len(full_test) == MNIST_TEST


def test_limit_larger_than_the_split_keeps_all_of_it(cifar_root: Path) -> None:
    data = {"name": "cifar10", "root": str(cifar_root), "limit_train": 10_000, "limit_test": 20}

    train, test = load_data(parse_config({"data": data}))

    assert (len(train), len(test)) == (5 * CIFAR_PER_BATCH, CIFAR_TEST)


def test_limit_train_sets_the_clients_data(mnist_root: Path) -> None:
    cfg = tiny(
        {"name": "mnist", "root": str(mnist_root), "limit_train": 30, "limit_test": 10},
        {"name": "mlp", "hidden": [8]},
    )

    exp = build(cfg)

    assert len(exp.train) == 30 and len(exp.test) == 10
    assert sum(c.inner.numel() + c.outer.numel() for c in exp.clients) == 30


# ------------------------------------------------------------------------ end to end
E2E = {
    "mnist-mlp": ("mnist", {"name": "mlp", "hidden": [16]}),
    "mnist-cnn7": ("mnist", {"name": "cnn7", "channels": [2, 4], "hidden": [8, 8]}),
    "cifar10-resnet18": ("cifar10", {"name": "resnet18", "widths": [4, 8, 8, 8]}),
    "cifar10-resnet12": ("cifar10", {"name": "resnet12", "widths": [4, 4, 8, 8]}),
    "cifar10-cnn": ("cifar10", {"name": "cnn", "channels": [4, 8]}),
}


@pytest.mark.parametrize("case", list(E2E))
def test_two_masked_rounds_on_tiny_data(case: str, mnist_root: Path, cifar_root: Path) -> None:
    data_name, model = E2E[case]
    root = mnist_root if data_name == "mnist" else cifar_root
    cfg = tiny({"name": data_name, "root": str(root)}, model)

    exp = build(cfg)
    result = run(cfg, progress=False, save=False)

    assert exp.simulation.masks is not None  # the importance policy on the model's plan
    assert (
        type(exp.model).__name__
        == {
            "mlp": "MLP",
            "cnn": "SmallCNN",
            "cnn7": "CNN7",
            "resnet12": "ResNet12",
            "resnet18": "ResNet18",
        }[model["name"]]
    )
    assert len(result.rounds) == 2
    for row in result.rounds:
        assert math.isfinite(row["inner_loss"]) and math.isfinite(row["outer_loss"])
        assert 0.0 <= row["test_accuracy"] <= 1.0 and math.isfinite(row["test_loss"])
        assert row["clients"] == [0, 1, 2] and not row["rejected_updates"]
    assert 0.0 <= result.final["test_accuracy"] <= 1.0
    # client 1 trains the half-width submodel: fewer bytes than the full-width client 0
    for phase in ("train.inner", "train.outer"):
        cost = {e["client"]: e["bytes_down"] for e in result.ledger if e["phase"] == phase}
        assert cost[1] < cost[0] == cost[2], phase
    # random images and labels leave nothing to learn; the updates must still reach x and y
    for block in ("x", "y"):
        start, end = getattr(exp.initial_state, block), getattr(result.state, block)
        assert all(torch.isfinite(t).all() for t in end.values()), block
        assert any(not torch.equal(end[k], t) for k, t in start.items()), block


def test_static_batchnorm_applies_to_resnet(cifar_root: Path) -> None:
    data = {"name": "cifar10", "root": str(cifar_root)}
    model = {"name": "resnet18", "widths": [4, 4, 4, 4]}
    static = tiny(data, {**model, "batchnorm": "static", "calibration_samples": 16})
    aggregate = tiny(data, model)

    exp = build(static)
    result = run(static, progress=False, save=False)
    aggregated = run(aggregate, progress=False, save=False)

    assert exp.initial_state.buffers  # ResNet-18 has BatchNorm statistics
    for name, tensor in exp.initial_state.buffers.items():
        assert torch.equal(result.state.buffers[name], tensor), name  # never aggregated
    assert any(
        not torch.equal(aggregated.state.buffers[name], tensor)
        for name, tensor in exp.initial_state.buffers.items()
    )
    up = {
        label: next(e["bytes_up"] for e in r.ledger if e["phase"] == "train.inner")
        for label, r in (("static", result), ("aggregate", aggregated))
    }
    assert up["static"] < up["aggregate"]  # no statistics sent up
    assert math.isfinite(result.final["test_loss"])


@pytest.mark.float_sensitive
def test_evaluation_in_chunks_matches_one_pass(
    mnist_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunking the test set changes only the batch size of each forward pass, and a kernel
    may block (so sum) a convolution or product differently by batch size: the claim is
    equality up to rounding, checked in float64 where that rounding is orders of magnitude
    below the bound (in float32 the loss was bitwise equal on every kernel here, but nothing
    guarantees that)."""
    import radbo.experiment

    cfg = tiny(
        {"name": "mnist", "root": str(mnist_root)},
        {"name": "cnn", "channels": [4]},
        runtime={"dtype": "float64"},
    )
    exp = build(cfg)
    state = {**exp.initial_state.x, **exp.initial_state.y, **exp.initial_state.buffers}
    whole = exp.simulation.evaluate(state)

    monkeypatch.setattr(radbo.experiment.evaluation, "_EVAL_BATCH", 7)  # 20 test images: 7 + 7 + 6
    chunked = build(cfg).simulation.evaluate(state)

    assert exp.test.features.dtype == torch.float64
    # argmax: the smallest gap between an example's two largest logits is 0.036, their
    # rounding (below) ~300 u x 0.26 = 1e-14 (logits below 0.26): no prediction can flip
    assert chunked["accuracy"] == whole["accuracy"]
    # float64: each logit is a few hundred roundings (3x3 conv to 4 channels, BatchNorm, average
    # pooling, linear head) of u = 1.1e-16 times its terms' magnitude, so a reordering moves the
    # mean cross-entropy by ~1e-14 relative; measured bitwise equal (0) on default/avx2/avx512
    # kernels; bound 1e-10
    assert chunked["loss"] == pytest.approx(whole["loss"], rel=1e-10)
