"""The paper reproduction scripts in benchmarks/paper/ run end to end at a tiny size and write
their markdown table and PNG (their default sizes take minutes: BENCHMARKS.md has the tables).

Default suite (about 10 s on one core): the RABO few-shot and scalability scripts on a tiny
Omniglot that the test writes in the real layout, the up-front refusal of configurations the
data cannot serve, and the device flag. Opt-in (``-m slow``; CI runs it): every script at a tiny
size on its default data, about one minute on one core together.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from radbo.config import parse_config
from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "benchmarks" / "paper"

FEWSHOT_ROWS = [
    "untrained backbone",
    "RABO",
    "RABO, refit 3",
    "RAFBO",
    "FedMBO (full model)",
    "FedAvg (full model)",
    "Dist-ProtoNet",
    "Dist-ProtoNet, nearest prototype",
    "Dist-MAML",
    "Static (HeteroFL)",
    "OAP",
    "FedRolex",
    "FIARSE",
]
LOSS_TUNING_ROWS = [
    "RABO",
    "RAFBO",
    "FedMBO (full model)",
    "RABO (full model)",
    "FedAvg (full model, no tuning)",
    "Static (HeteroFL)",
    "FedRolex",
]
#: script -> (tiny arguments, rows its table must have)
SCRIPTS: dict[str, tuple[list[str], list[str]]] = {
    "rabo_fewshot": (
        "--seeds 0 --rounds 1 --width 4 --image-size 8 --episodes 10 --shots 1 --queries 3 "
        "--refit-steps 3".split(),
        FEWSHOT_ROWS,
    ),
    "rabo_costs": (
        "--models conv4 --width 8 --seeds 0 --rounds 2 --eval-every 1 --episodes 10 "
        "--refit-steps 3".split(),
        ["RABO", "RABO, refit 3", "RAFBO", "FedMBO", "Static (HeteroFL)"],
    ),
    "rabo_coverage": (
        "--seeds 0 --rounds 2 --eval-every 1 --episodes 10 --width 8".split(),
        ["RABO", "RAFBO"],
    ),
    "rabo_scalability": (
        "--seeds 0 --rounds 1 --width 4 --image-size 8 --episodes 10 --clients 2 12".split(),
        ["classes per client", "untrained backbone", "RABO", "RAFBO"],
    ),
    "rabo_loss_tuning": (
        "--seeds 0 --rounds 1 --width 8".split(),
        LOSS_TUNING_ROWS,
    ),
    "fo_hpo": (
        "--seeds 0 --rounds 10 --examples 400".split(),
        ["FedSVRBGD-FO (p=4)", "FedSVRBGD-FO (p=16)", "FedNest", "FedMBO"],
    ),
    "simfbo_fig2": (
        "--seeds 0 --rounds 8".split(),
        ["SimFBO", "FedNest", "LFedNest", "FBO-AggITD"],
    ),
    "shrofbo_heterogeneous": (
        "--seeds 0 --rounds 2 --eval-every 1".split(),
        ["SimFBO", "ShroFBO"],
    ),
}
NUMBER = r"\d\.\d{3}"


def load(name: str) -> ModuleType:
    return load_script(PAPER / f"{name}.py", f"paper_{name}")


def row(table: str, name: str, *, k: int | None = None) -> list[str]:
    """The cells of the table row named ``name`` (with K = ``k`` in its second column)."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == name and (k is None or cells[1] == str(k)):
            return cells[1:]
    raise AssertionError(f"no row {name!r} (K = {k}) in\n{table}")


def write_omniglot(root: Path, characters: int, drawings: int = 6) -> None:
    """A tiny Omniglot in the real layout (``radbo.data.readers.read_omniglot``):
    ``images_background`` and ``images_evaluation``, each ``<alphabet>/<character>/<id>.png``
    (105x105 binary drawings in the original; 12x12 here), ``characters`` characters on each
    side over two alphabets."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("images_background", "images_evaluation"):
        for c in range(characters):
            folder = root / split / f"Alphabet_{c % 2}" / f"character{c + 1:02d}"
            folder.mkdir(parents=True)
            for i in range(drawings):
                pixels = (rng.random((12, 12)) > 0.5).astype(np.uint8) * 255
                Image.fromarray(pixels, mode="L").save(folder / f"{c:04d}_{i:02d}.png")


@pytest.fixture(scope="module")
def omniglot(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("omniglot")
    write_omniglot(root, characters=12)  # 12 meta-train and 12 meta-test characters
    return root


# ------------------------------------------------------------------------- default suite
def test_fewshot_runs_every_row_on_omniglot_in_the_real_layout(omniglot: Path, tmp_path, capsys):
    """Table II on a tiny Omniglot, two clients: every method's row holds one accuracy ± CI per seed, the
    mean and seed spread, and the markdown names the device and the command."""
    args = "--seeds 0 1 --rounds 1 --width 4 --image-size 12 --episodes 10 --shots 1 --queries 3"
    args += " --refit-steps 3 --clients 2"  # 6 of the 12 characters each

    load("rabo_fewshot").main([*args.split(), "--omniglot", str(omniglot), "--out", str(tmp_path)])

    table = (tmp_path / "rabo_fewshot.md").read_text()
    assert (tmp_path / "rabo_fewshot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in FEWSHOT_ROWS:
        seed0, seed1, mean, *_ = row(table, name)
        assert re.fullmatch(rf"{NUMBER} ± {NUMBER}", seed0) and re.fullmatch(
            rf"{NUMBER} ± {NUMBER}", seed1
        )
        assert re.fullmatch(rf"{NUMBER} \({NUMBER}\)", mean), mean
        first, second = float(seed0.split()[0]), float(seed1.split()[0])
        assert float(mean.split()[0]) == pytest.approx((first + second) / 2, abs=1.1e-3)
    assert row(table, "RABO")[-1] == "0.760"  # the paper's 5-way 1-shot RABO, in its column
    assert "5-way 1-shot, 3 queries per class, Omniglot" in table
    assert "Measured on CPU " in table  # the device that produced the numbers
    assert "benchmarks/paper/rabo_fewshot.py" in table and "--omniglot" in table
    assert "OMP_NUM_THREADS=1" in capsys.readouterr().out


def test_scalability_marks_client_counts_without_enough_classes(omniglot: Path, tmp_path):
    """Table III on a tiny Omniglot of 12 meta-train characters: 2 clients hold 6 each and run;
    3 clients hold 4 each, fewer than a 5-way episode needs, so that column says so instead
    of running (or crashing)."""
    args = "--seeds 0 --rounds 1 --width 4 --image-size 12 --episodes 10 --shots 1 --queries 3"
    args += " --clients 2 3"

    load("rabo_scalability").main(
        [*args.split(), "--omniglot", str(omniglot), "--out", str(tmp_path)]
    )

    table = (tmp_path / "rabo_scalability.md").read_text()
    assert row(table, "classes per client", k=1)[1:] == ["6", "4"]
    for name in ("untrained backbone", "RABO", "RAFBO"):
        served, unserved = row(table, name, k=1)[1:]
        assert re.fullmatch(rf"{NUMBER} ± {NUMBER}", served), (name, served)
        assert unserved == "not enough classes"
    assert "3 clients on omniglot (12 meta-train classes" in table
    assert "use at most 2 clients" in table
    assert "Measured on CPU " in table


def test_queries_default_to_the_rest_of_a_characters_drawings_on_omniglot(omniglot: Path):
    fewshot = load("rabo_fewshot")

    _, on_omniglot = fewshot.parse_args(["--omniglot", str(omniglot), "--shots", "1"])
    _, on_digits = fewshot.parse_args(["--shots", "1"])

    assert on_omniglot.queries == 19 and on_digits.queries == 15  # the paper's 20 - K; 15


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        # digits has 5 meta-train classes: no 20-way episode
        (
            "rabo_fewshot",
            ["--ways", "20"],
            "digits has 5 meta-train classes with at least shots + queries = 20 examples, a "
            "20-way episode needs 20; use --ways 5 or fewer, or --omniglot PATH",
        ),
        # 12 characters over 3 clients: 4 each, a 5-way episode needs 5
        (
            "rabo_fewshot",
            ["--clients", "3", "--shots", "1", "--queries", "3", "OMNIGLOT"],
            "client 0 holds 4 classes with at least shots + queries = 4 examples (not enough "
            "classes: a 5-way episode needs 5); use at most 2 clients",
        ),
        # 6 drawings per character, 1 + 19 asked for
        (
            "rabo_fewshot",
            ["--shots", "1", "OMNIGLOT"],
            "omniglot has 0 meta-train classes with at least shots + queries = 20 examples, a "
            "5-way episode needs 5; use shots + queries <= 6 (e.g. --queries 5)",
        ),
        (
            "rabo_fewshot",
            ["--model", "resnet12", "--image-size", "8"],
            "--model resnet12: needs images of at least 16x16, but digits gives 1x8x8",
        ),
        (
            "rabo_coverage",
            ["--clients", "50"],
            "50 clients on digits (5 meta-train classes, 5-way 5-shot, 15 queries): client",
        ),
        (
            "rabo_costs",
            ["--episodes", "10", "OMNIGLOT"],
            "omniglot has 0 meta-train classes with at least shots + queries = 20 examples",
        ),
        (
            "rabo_scalability",
            ["--ways", "20"],
            "digits has 5 meta-train classes with at least shots + queries = 6 examples",
        ),
    ],
)
def test_a_configuration_the_data_cannot_serve_is_refused_before_any_run(
    script: str, args: list[str], message: str, omniglot: Path, tmp_path, monkeypatch
):
    module = load(script)

    def no_run(*_args, **_kwargs):
        raise AssertionError("a run started before the configuration was checked")

    for name in ("run", "build"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, no_run)
    argv = ["--omniglot", str(omniglot)] if "OMNIGLOT" in args else []
    argv += [a for a in args if a != "OMNIGLOT"] + ["--out", str(tmp_path / "out")]

    with pytest.raises(SystemExit) as refused:
        module.main(argv)

    text = str(refused.value)
    assert text.startswith("refused: ") and "\n" not in text
    assert message in text
    assert not (tmp_path / "out").exists()  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_loss_tuning_has_every_row_and_costs_as_fractions_of_fedmbo(tmp_path, capsys):
    """Sec. V-B on long-tailed digits, one round: every method's row holds its balanced test
    accuracy, FedMBO's cost fractions are exactly 1, each fraction is the row's GFLOP / MB over
    FedMBO's (one seed), and the submodel rows at r = 1/2 cost less than their full models."""
    args = "--seeds 0 --rounds 1 --width 8 --rafbo-coordinates 2".split()

    load("rabo_loss_tuning").main([*args, "--out", str(tmp_path)])

    table = (tmp_path / "rabo_loss_tuning.md").read_text()
    for png in ("rabo_loss_tuning.png", "rabo_loss_tuning_costs.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cells = {name: row(table, name) for name in LOSS_TUNING_ROWS}
    fedmbo = cells["FedMBO (full model)"]

    def ratio_of_printed(total: str, reference: str, fraction: str) -> bool:
        # the totals are printed to 3 decimals: their ratio is known to within that rounding
        t, ref, f = float(total), float(reference), float(fraction)
        return abs(t / ref - f) <= 5e-4 * (1 + t / ref) / (ref - 5e-4) + 5e-4

    for name, (seed0, mean, gflop, compute, mb, sent, _paper) in cells.items():
        assert re.fullmatch(NUMBER, seed0) and mean == f"{seed0} (0.000)", (name, mean)
        assert ratio_of_printed(gflop, fedmbo[2], compute), (name, gflop, compute)
        assert ratio_of_printed(mb, fedmbo[4], sent), (name, mb, sent)
    assert (fedmbo[3], fedmbo[5]) == ("1.000", "1.000")
    assert cells["RABO"][-1] == "0.50, 0.25"  # the paper's Fig. 6 fractions
    assert float(cells["RABO"][3]) < float(cells["RABO (full model)"][3])
    assert float(cells["RABO"][5]) < float(cells["RABO (full model)"][5])
    # Static and FedRolex train submodels of the same size: the same cost
    assert cells["Static (HeteroFL)"][2:] == cells["FedRolex"][2:]
    assert "imbalance 10" in table and "Measured on CPU " in table
    assert "benchmarks/paper/rabo_loss_tuning.py" in table
    assert "OMP_NUM_THREADS=1" in capsys.readouterr().out


def test_loss_tuning_cost_fractions_are_per_seed_ratios_to_fedmbo_averaged():
    """Seed 0: 2/4 and seed 1: 1/1 of FedMBO's FLOPs average to 0.75; FedMBO's own is 1."""
    costs = load("rabo_loss_tuning").costs
    totals = {
        "FedMBO (full model)": [{"flops": 4.0}, {"flops": 1.0}],
        "RABO": [{"flops": 2.0}, {"flops": 1.0}],
    }

    fractions = costs(totals, "flops")

    assert fractions == {"FedMBO (full model)": 1.0, "RABO": 0.75}


def test_device_cuda_is_refused_up_front_without_a_gpu(tmp_path):
    with pytest.raises(SystemExit, match="refused: --device cuda: no CUDA device is available"):
        load("rabo_fewshot").main(["--device", "cuda", "--out", str(tmp_path)])


def test_device_flag_sets_the_runtime_device_of_every_run():
    fewshot = load("rabo_fewshot")
    _, args = fewshot.parse_args(["--device", "cuda", "--full"])

    config = fewshot.base_config(args, seed=0)

    assert config["runtime"] == {"device": "cuda"}
    assert config["model"] == {"name": "conv4", "width": 64, "batchnorm": "static"}
    assert (args.rounds, args.episodes, args.image_size, args.clients) == (200, 600, 28, 10)


# ------------------------------------------------------------------------------- opt-in
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_paper_script_writes_its_table_and_plot(name: str, tmp_path, capsys) -> None:
    args, rows = SCRIPTS[name]

    load(name).main([*args, "--out", str(tmp_path)])

    table = (tmp_path / f"{name}.md").read_text()
    png = (tmp_path / f"{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    for row_name in rows:
        assert f"| {row_name}" in table, (name, row_name)
    assert f"benchmarks/paper/{name}.py" in table  # the command that made it
    assert "OMP_NUM_THREADS=1" in capsys.readouterr().out
    if name.startswith("rabo_"):
        assert "Measured on CPU " in table or "Measured on GPU " in table


@pytest.mark.slow
def test_scalability_on_digits_reports_too_few_examples_per_class(tmp_path) -> None:
    """Digits' five meta-train classes split iid over 12 clients leave about 15 examples of
    each class per client: enough for 1-shot with 5 queries, not for 5-shot."""
    args, _ = SCRIPTS["rabo_scalability"]

    load("rabo_scalability").main([*args, "--out", str(tmp_path)])

    table = (tmp_path / "rabo_scalability.md").read_text()
    assert re.fullmatch(rf"{NUMBER} ± {NUMBER}", row(table, "RABO", k=1)[2])
    assert row(table, "RABO", k=5)[2] == "too few examples per class"


def test_loss_tuning_at_the_papers_size_is_resnet18_and_every_config_is_valid():
    """``--full`` is the paper's Sec. V-B model, ResNet-18 at widths 64-512, for the VS rows
    (``vs_resnet18``) and the plain ones (``resnet18``); every row's config is read (not run)."""
    script = load("rabo_loss_tuning")
    _, args = script.parse_args(["--full"])
    assert args.model == "resnet18" and args.width == 64 and args.rounds == 200
    models = set()
    for name, sections in script.methods(args).items():
        config = parse_config(script.merge(script.base_config(args, 0), sections))
        models.add((config.model.name, tuple(config.model.widths)))
        assert config.data.image_size == 16, name  # digits upsampled for the ResNet
    assert models == {("vs_resnet18", (64, 128, 256, 512)), ("resnet18", (64, 128, 256, 512))}
    _, default = script.parse_args([])
    assert default.model == "mlp" and default.width == 128


@pytest.mark.parametrize("name", ["rabo_fewshot", "rabo_loss_tuning"])
def test_coordinate_batch_reaches_only_the_rafbo_row_and_only_when_set(name: str):
    """``--coordinate-batch`` (for ``--device cuda``) sets RAFBO's ``[estimator]
    coordinate_batch``; by default the RAFBO config reads as before the flag existed."""
    script = load(name)
    _, default = script.parse_args([])
    _, batched = script.parse_args(["--coordinate-batch", "16"])
    assert "coordinate_batch" not in script.methods(default)["RAFBO"]["estimator"]
    for row, sections in script.methods(batched).items():
        config = parse_config(script.merge(script.base_config(batched, 0), sections))
        expected = 16 if row == "RAFBO" else None
        assert getattr(config.estimator, "coordinate_batch", None) == expected, row
