"""One client-side build: the simulation, a Flower node holding its own data and the export
obtain their client side (model, structure plan, algorithm, runtime) from
:func:`radbo.experiment.clientside.client_side`, and a node's equals the server's."""

import importlib

import pytest
import torch

from radbo.experiment import build, clientside
from radbo.export import export_submodels, round0_assignment
from radbo.flower import nodedata
from radbo.flower.nodedata import load_node_data, node_side, write_node_data
from tests.configs import small_config
from tests.helpers import assert_same_state

#: ``radbo.experiment.build`` the module (the package's ``build`` is the function)
build_module = importlib.import_module("radbo.experiment.build")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    # the demo's fleet, masked (importance policy): plan, budgets and mean local steps all count
    config = small_config(rounds=1, baseline={"enabled": False})
    exp = build(config)
    folders = write_node_data(config, tmp_path_factory.mktemp("nodes"), exp)
    return config, exp, folders


def test_simulation_node_and_export_call_the_one_client_side_build(written, monkeypatch, tmp_path):
    # Arrange: one spy around the one function, under each name that calls it
    config, _, folders = written
    assert build_module.client_side is clientside.client_side
    assert nodedata.client_side is clientside.client_side
    calls: list[str] = []

    def spy(where):
        def client_side(*args, **kwargs):
            calls.append(where)
            return clientside.client_side(*args, **kwargs)

        return client_side

    monkeypatch.setattr(build_module, "client_side", spy("build"))
    monkeypatch.setattr(nodedata, "client_side", spy("node"))

    # Act / Assert: the simulation, a node with its own data, and the export
    exp = build(config)
    assert calls == ["build"]
    assert exp.simulation.runtime is exp.client_side.runtime
    assert exp.simulation.algorithm is exp.client_side.algorithm
    node_side(config, load_node_data(folders[0]))
    assert calls == ["build", "node"]
    export_submodels(config, tmp_path / "export")
    assert calls == ["build", "node", "build"]


def test_a_node_s_client_side_equals_the_simulation_s(written):
    # Arrange
    config, exp, folders = written
    server = exp.client_side
    plan, index_sets, _ = round0_assignment(exp)
    assert plan is server.model.plan  # the export's plan is the client side's
    for c, folder in enumerate(folders):
        # Act
        held = load_node_data(folder)
        node = node_side(config, held)
        side = node.side

        # Assert: the same algorithm (hyperparameters and wiring, the fleet's mean local
        # steps included), model, tensor roles and task
        assert type(side.algorithm) is type(server.algorithm)
        assert side.algorithm == server.algorithm
        wiring = clientside.algorithm_wiring(config, side.model, held.population_steps)
        assert wiring == clientside.algorithm_wiring(config, server.model, exp.population_steps)
        assert side.phases.keys() == server.phases.keys()
        assert (side.model.outer, side.model.inner, side.model.buffers) == (
            server.model.outer,
            server.model.inner,
            server.model.buffers,
        )
        assert_same_state(side.model.model.state_dict(), server.model.model.state_dict())
        assert side.runtime.problem == server.runtime.problem
        # the same submodel skeleton for the client's round-0 mask
        idx = index_sets[c]
        assert plan is not None and side.model.plan is not None
        shapes = {k: v.shape for k, v in side.runtime.module_for(idx).state_dict().items()}
        want = {k: v.shape for k, v in server.runtime.module_for(idx).state_dict().items()}
        assert shapes == want
        # the same examples, in the same order, as the server's indices pick
        data = exp.clients[c]
        for mine, theirs in ((node.data.inner, data.inner), (node.data.outer, data.outer)):
            assert torch.equal(side.runtime.features[mine], server.runtime.features[theirs])
            assert torch.equal(side.runtime.labels[mine], server.runtime.labels[theirs])
