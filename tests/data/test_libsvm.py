"""``[data] name = "libsvm"`` (LIBSVM sparse text files), the IDX writer and
``write_digits_as_mnist``.

The LIBSVM files are written by the tests in the real format (tmp_path); nothing is
downloaded. Values are compared exactly: a decimal in the file and the same decimal as a Python
literal both round to the nearest float64.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from radbo.cli import main
from radbo.config import ConfigError, parse_config
from radbo.data import (
    Dataset,
    DigitsData,
    LibSVMData,
    read_idx,
    read_libsvm,
    read_mnist,
    train_test_split,
    write_digits_as_mnist,
    write_idx,
)
from radbo.experiment import build, load_data, run
from radbo.randomness import Stream, generator

FORMAT_TEXT = """# a9a-like toy file: comments, blank lines, +1/-1 labels
+1 1:0.5 3:-2.25 # trailing comment

-1 2:1e-3
+1
-1\t1:7 4:0.125
"""
FORMAT_FEATURES = [
    [0.5, 0.0, -2.25, 0.0],
    [0.0, 1e-3, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0],
    [7.0, 0.0, 0.0, 0.125],
]


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def toy_lines(n: int, dim: int, seed: int) -> str:
    """``n`` examples, labels alternating -1/+1, about 70 % of the ``dim`` features present
    (3 decimals); the first two features carry the label."""
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        label = 1 if i % 2 else -1
        pairs = [
            f"{j + 1}:{round(float(rng.normal() + 0.8 * label * (j < 2)), 3)}"
            for j in range(dim)
            if rng.random() < 0.7
        ]
        lines.append(f"{label:+d} {' '.join(pairs)}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the reader


def test_read_libsvm_exact_values_comments_blank_lines_and_empty_rows(tmp_path: Path) -> None:
    path = write(tmp_path / "toy.svm", FORMAT_TEXT)

    features, labels = read_libsvm(path)

    assert features.dtype == np.float64 and labels.dtype == np.int64
    assert np.array_equal(features, np.array(FORMAT_FEATURES))
    assert labels.tolist() == [1, -1, 1, -1]


def test_read_libsvm_num_features_pads_and_gzip_reads_the_same(tmp_path: Path) -> None:
    plain = write(tmp_path / "toy.svm", FORMAT_TEXT)
    packed = tmp_path / "toy.svm.gz"
    packed.write_bytes(gzip.compress(FORMAT_TEXT.encode()))

    wide, _ = read_libsvm(plain, num_features=6)
    unpacked, labels = read_libsvm(packed)

    assert wide.shape == (4, 6)
    assert np.array_equal(wide[:, :4], np.array(FORMAT_FEATURES)) and not wide[:, 4:].any()
    assert np.array_equal(unpacked, np.array(FORMAT_FEATURES))
    assert labels.tolist() == [1, -1, 1, -1]


@pytest.mark.parametrize(
    ("text", "line", "problem"),
    [
        ("# header\n+1 1:1\n\n-1 2:abc\n", 4, "'2:abc' is not <index>:<value>"),
        ("+1 1:1\n-1 2\n", 2, "'2' is not <index>:<value> (no ':')"),
        ("+1 0:1\n", 1, "index 0 in '0:1' is below 1 (LIBSVM indices are 1-based)"),
        ("+1 1:1\n+1 3:1 2:1\n", 2, "index 2 follows index 3"),
        ("+1 1:1\n+1 2:1 2:5\n", 2, "index 2 follows index 2"),
        ("+1 1:1\nspam 1:1\n", 2, "label 'spam' is not a number"),
        ("+1 1:1\n1.5 1:1\n", 2, "label '1.5' is not an integer class label"),
        ("+1 1:1\n+1 1:nan\n", 2, "value 'nan' of index 1 is not finite"),
        ("+1 1:1e400\n", 1, "value '1e400' of index 1 is not finite"),
    ],
)
def test_malformed_line_names_the_file_and_line(
    tmp_path: Path, text: str, line: int, problem: str
) -> None:
    path = write(tmp_path / "bad.svm", text)

    with pytest.raises(ValueError) as err:
        read_libsvm(path)

    message = str(err.value)
    assert message.startswith(f"LIBSVM: {path}, line {line}: {problem}")
    assert len(message.splitlines()) == 1


def test_index_above_num_features_and_other_read_errors(tmp_path: Path) -> None:
    path = write(tmp_path / "wide.svm", "+1 1:1\n-1 2:1 5:1\n")
    empty = write(tmp_path / "empty.svm", "# only a comment\n\n")
    broken = tmp_path / "broken.svm.gz"
    broken.write_bytes(b"not gzip at all")

    with pytest.raises(ValueError, match=r"wide.svm, line 2: index 5 exceeds num_features = 3"):
        read_libsvm(path, num_features=3)
    with pytest.raises(ValueError, match="empty.svm holds no examples"):
        read_libsvm(empty)
    with pytest.raises(ValueError, match="broken.svm.gz could not be read"):
        read_libsvm(broken)
    with pytest.raises(FileNotFoundError, match="nothere.svm is missing"):
        read_libsvm(tmp_path / "nothere.svm")


# ----------------------------------------------------------------------------- [data] libsvm


def test_labels_are_numbered_in_sorted_order_over_both_files(tmp_path: Path) -> None:
    # 12 < 3 as text, 3 < 7 < 12 as numbers; 20 occurs only in the test file
    train = write(tmp_path / "train.svm", "7 1:1\n3 2:2\n12 3:3\n3 1:4\n")
    test = write(tmp_path / "test.svm", "12 5:0.5\n20 1:1\n")
    config = LibSVMData(name="libsvm", path=str(train), test_path=str(test))

    train_set, test_set = config.load(seed=0, flat=True)

    assert train_set.labels.tolist() == [1, 0, 2, 0]
    assert test_set.labels.tolist() == [2, 3]
    assert train_set.num_classes == test_set.num_classes == 4
    # num_features unset: the largest index of both files (5), the narrower file padded
    assert torch.equal(
        train_set.features,
        torch.tensor(
            [[1, 0, 0, 0, 0], [0, 2, 0, 0, 0], [0, 0, 3, 0, 0], [4, 0, 0, 0, 0]],
            dtype=torch.float64,
        ),
    )
    assert torch.equal(
        test_set.features,
        torch.tensor([[0, 0, 0, 0, 0.5], [1, 0, 0, 0, 0]], dtype=torch.float64),
    )
    assert (train_set.name, test_set.name) == ("train.svm/train", "test.svm/test")


@pytest.mark.parametrize(("written", "numbered"), [(("-1", "+1"), (0, 1)), (("0", "1"), (0, 1))])
def test_binary_labels_become_0_and_1(
    tmp_path: Path, written: tuple[str, str], numbered: tuple[int, int]
) -> None:
    train = write(tmp_path / "a.svm", f"{written[1]} 1:1\n{written[0]} 1:2\n")
    test = write(tmp_path / "a.t", f"{written[0]} 1:3\n")

    train_set, test_set = LibSVMData(name="libsvm", path=str(train), test_path=str(test)).load(
        seed=0, flat=True
    )

    assert train_set.labels.tolist() == [numbered[1], numbered[0]]
    assert test_set.labels.tolist() == [numbered[0]] and train_set.num_classes == 2


def test_without_test_path_a_seeded_stratified_fraction_is_held_out(tmp_path: Path) -> None:
    path = write(tmp_path / "toy.svm", toy_lines(20, 4, seed=0))
    features, raw = read_libsvm(path)
    whole = Dataset(
        torch.from_numpy(features), torch.from_numpy((raw > 0).astype(np.int64)), 2, "toy.svm"
    )

    train, test = LibSVMData(name="libsvm", path=str(path), test_fraction=0.25).load(
        seed=3, flat=True
    )
    default_train, default_test = LibSVMData(name="libsvm", path=str(path)).load(seed=3, flat=True)

    expected_train, expected_test = train_test_split(whole, 0.25, generator(3, Stream.SPLIT))
    assert torch.equal(train.features, expected_train.features)
    assert torch.equal(test.labels, expected_test.labels) and len(test) == 5
    assert torch.equal(test.features, expected_test.features)
    assert (len(default_train), len(default_test)) == (16, 4)  # test_fraction 0.2 by default


def test_config_errors_are_one_line_and_name_the_field(tmp_path: Path) -> None:
    present = write(tmp_path / "a.svm", "+1 1:1\n-1 1:2\n")
    one_class = write(tmp_path / "one.svm", "+1 1:1\n+1 1:2\n")
    missing = tmp_path / "nothere.svm"

    def load_error(data: dict) -> str:
        with pytest.raises(ConfigError) as err:
            load_data(parse_config({"data": data}))
        return str(err.value)

    def parse_error(data: dict) -> str:
        with pytest.raises(ConfigError) as err:
            parse_config({"data": data})
        return str(err.value)

    messages = [
        load_error({"name": "libsvm", "path": str(missing)}),
        load_error({"name": "libsvm", "path": str(present), "test_path": str(missing)}),
        load_error({"name": "libsvm", "path": str(one_class)}),
        parse_error({"name": "libsvm", "path": "a", "test_path": "b", "test_fraction": 0.1}),
        parse_error({"name": "libsvm", "path": "a", "num_features": 0}),
        parse_error({"name": "libsvm"}),
    ]

    assert all(len(m.splitlines()) == 1 for m in messages)
    assert messages[0] == (
        f"config error: data.name = 'libsvm': data.path = '{missing}' is missing; expected a "
        "LIBSVM text file ('<label> <index>:<value> ...' lines, 1-based indices)"
    )
    assert f"data.test_path = '{missing}' is missing" in messages[1]
    assert "holds only label 1; expected at least two classes" in messages[2]
    assert "give test_path (a test file) or test_fraction" in messages[3]
    assert messages[4].startswith("config error: data.num_features = 0")
    assert messages[5].startswith("config error: data.path = ") and "required" in messages[5]


def test_cli_missing_file_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nothere.svm"
    config = write(
        tmp_path / "run.toml",
        f'rounds = 2\n[data]\nname = "libsvm"\npath = "{missing.as_posix()}"\n'
        '[model]\nname = "logistic"\n[task]\nname = "feature_l2"\n[mask]\npolicy = "none"\n',
    )

    code = main(["run", str(config), "--quiet", "--output-dir", str(tmp_path / "out")])

    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.splitlines() == [err]
    assert err.startswith(f"config error: data.name = 'libsvm': data.path = '{missing}'")
    assert not (tmp_path / "out").exists()


def feature_l2_config(path: Path, **data: object) -> dict:
    """Per-feature L2 of a logistic regression (examples/feature_l2.toml's task, model and
    algorithm) on a LIBSVM file: 3 clients, 2 rounds, float64."""
    return {
        "seed": 0,
        "rounds": 2,
        "eval_every": 1,
        "data": {"name": "libsvm", "path": str(path), **data},
        "partition": {"kind": "iid"},
        "model": {"name": "logistic", "init_log_l2": -1.0},
        "task": {"name": "feature_l2"},
        "fleet": {"num_clients": 3},
        "mask": {"policy": "none"},
        "algorithm": {"name": "rabo", "inner_steps": 2, "batch_size": 8, "outer_batch_size": 8},
        "estimator": {"name": "cg", "max_iter": 3},
        "runtime": {"dtype": "float64"},
    }


def test_feature_l2_runs_end_to_end_on_a_libsvm_file(tmp_path: Path) -> None:
    path = write(tmp_path / "toy.svm", toy_lines(60, 6, seed=0))
    config = parse_config(feature_l2_config(path, test_fraction=0.25))

    experiment = build(config)
    first = run(config, progress=False, save=False)
    again = run(config, progress=False, save=False)

    assert (len(experiment.train), len(experiment.test)) == (45, 15)
    assert experiment.train.features.dtype == torch.float64
    assert experiment.model.outer_param_names() == ["log_l2"]
    x = first.state.x["log_l2"]
    assert x.shape == (6,) and bool(torch.isfinite(x).all())
    assert float((x + 1.0).abs().max()) > 0  # two rounds of outer steps moved x off its start
    assert torch.equal(x, again.state.x["log_l2"])  # same seed, same run
    assert len(first.rounds) == 2
    assert np.isfinite(first.final["test_loss"]) and 0 <= first.final["test_accuracy"] <= 1


# ----------------------------------------------------------------------------- IDX and digits


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_write_idx_round_trips(tmp_path: Path, dtype: type) -> None:
    start = 0 if dtype is np.uint8 else -5  # negative values where the dtype has them
    array = np.arange(start, start + 24).reshape(2, 3, 4).astype(dtype)

    read = read_idx(write_idx(tmp_path / "a.idx.gz", array))

    assert read.dtype == np.dtype(dtype) and np.array_equal(read, array)


def test_write_idx_mnist_magic_and_errors(tmp_path: Path) -> None:
    images = write_idx(tmp_path / "i", np.zeros((2, 3, 3), dtype=np.uint8))
    labels = write_idx(tmp_path / "l", np.zeros(2, dtype=np.uint8))

    assert images.read_bytes()[:4] == (2051).to_bytes(4, "big")
    assert labels.read_bytes()[:4] == (2049).to_bytes(4, "big")
    with pytest.raises(ValueError, match="cannot write an array of dtype bool"):
        write_idx(tmp_path / "b", np.zeros(3, dtype=bool))


def test_digits_written_as_mnist_read_back(tmp_path: Path) -> None:
    folder = write_digits_as_mnist(tmp_path / "mnist", seed=0)
    train_images, train_labels = read_mnist(folder, train=True)
    test_images, test_labels = read_mnist(folder, train=False)
    train, test = DigitsData(image_size=28).splits(0, flat=False)

    assert train_images.shape == (1438, 28, 28) and test_images.shape == (359, 28, 28)
    assert train_images.dtype == np.uint8
    assert np.array_equal(train_labels, train.labels.numpy())
    assert np.array_equal(test_labels, test.labels.numpy())
    for images, split in ((train_images, train), (test_images, test)):
        pixels = split.features[:, 0].double()
        # the documented quantization, exactly, and hence within 0.5/255 of the digits data
        assert np.array_equal(images, (pixels * 255).round().clamp(0, 255).numpy())
        # exact up to float64 rounding: p * 255 is exact for a float32 p, so |p - n/255| <=
        # 0.5/255 exactly; only n/255 and the difference round (2 u <= 2.3e-16), far below 1e-12
        error = float((torch.from_numpy(images / 255.0) - pixels).abs().max())
        assert error <= 0.5 / 255 + 1e-12


def test_digits_as_mnist_feed_the_mnist_data_config(tmp_path: Path) -> None:
    plain = write_digits_as_mnist(tmp_path / "plain", seed=1)
    packed = write_digits_as_mnist(tmp_path / "packed", seed=1, gz=True)

    train, test = load_data(parse_config({"data": {"name": "mnist", "root": str(plain)}}))

    assert sorted(p.name for p in packed.iterdir()) == sorted(
        f"{p.name}.gz" for p in plain.iterdir()
    )
    assert np.array_equal(read_mnist(packed)[0], read_mnist(plain)[0])
    assert tuple(train.features.shape) == (1438, 784) and len(test) == 359
    assert not torch.equal(  # another seed, another split
        train.labels, torch.from_numpy(read_mnist(write_digits_as_mnist(tmp_path / "s0"))[1])
    )
