"""A model an edge runtime's exporter cannot take: ``radbo export`` records why in the
manifest (the exporter's own reason, as one line) and writes no file for it, instead of
failing the export. Every model of radbo's zoo exports to both formats
(tests/export/test_export_edge.py), so the refusal is shown on a model made to be refused: its
forward branches on the values of its input, which ``torch.export`` (under both the
ExecuTorch and the ONNX exporter) cannot trace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from radbo.edge import first_line, lower
from radbo.export import _edge_file, _EdgeSetup
from tests.export.test_export_edge import needs_edge


class BranchesOnData(nn.Module):
    """A linear model whose output sign depends on the input's values."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if bool(x.sum() > 0):  # data-dependent control flow: not traceable
            return out
        return -out


@needs_edge
@pytest.mark.parametrize("fmt", ["pte", "onnx"])
def test_a_model_the_exporter_refuses_is_recorded_with_its_exact_reason(
    fmt: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = BranchesOnData().eval()
    inputs = torch.randn(2, 4)
    with pytest.raises(Exception) as refused:  # the exporter's own refusal, asked directly
        lower(model, inputs, fmt)
    reason = first_line(refused.value)
    # a type name and the first line of the exporter's message, without terminal colours
    assert reason and "\n" not in reason and "\x1b" not in reason
    setup = _EdgeSetup(
        edge=(fmt,),
        quantize=None,
        runs=0,
        batches=[2],
        max_batch=2,
        calibration=inputs,
        test_features=inputs,
        test_labels=torch.zeros(2, dtype=torch.long),
    )
    with torch.no_grad():
        want = model(inputs)
    record = _edge_file(model, fmt, None, inputs, want, tmp_path, 0, setup)
    assert record == {"file": None, "error": reason}
    assert list(tmp_path.iterdir()) == []  # nothing half-written
