"""Staleness: measured on every versioned gradient, bounded by max_staleness."""

import numpy as np
import pytest

from kdist.ps import DenseGradient, ServiceOptions, StalenessStats, VariableClient, VariableInit
from kdist.ps import create_server
from tests.ps.conftest import sgd_config

pytestmark = pytest.mark.timeout(120)


def _one():
    return np.ones(4, "float32")


@pytest.fixture
def bounded():
    options = ServiceOptions(max_staleness=1, rpc_timeout_seconds=30)
    with create_server(options=options) as server, VariableClient(server.address) as client:
        client.create([VariableInit("w", np.zeros(4, "float32")),
                       VariableInit("v", np.zeros(4, "float32"))])
        client.configure_optimizer(sgd_config(1.0), ["w", "v"])
        yield client


def test_too_stale_gradients_are_rejected_not_applied(bounded):
    client = bounded
    assert client.push([DenseGradient("w", _one(), version=0)]).staleness == {"w": 0}
    assert client.push([DenseGradient("w", _one(), version=0)]).staleness == {"w": 1}
    # Version 2 now; a gradient from version 0 is 2 behind, over the bound of 1.
    result = client.push([DenseGradient("w", _one(), version=0),
                          DenseGradient("v", _one(), version=0)])
    assert result.rejected == ("w",)
    assert result.staleness == {"w": 2, "v": 0}
    assert result.versions == {"w": 2, "v": 1}
    [state] = client.pull(["w"])
    np.testing.assert_array_equal(state.value, np.full(4, -2.0))
    stats = client.stats()
    assert stats.variables["w"].rejected_updates == 1
    assert stats.variables["w"].applied_updates == 2
    assert stats.staleness.histogram == {0: 2, 1: 1, 2: 1}
    assert stats.staleness.max == 2 and stats.staleness.count == 4


def test_unversioned_gradients_are_never_rejected(bounded):
    for _ in range(4):
        assert bounded.push([DenseGradient("w", _one())]).rejected == ()
    assert bounded.stats().staleness.count == 0


def test_a_push_whose_gradients_are_all_rejected_is_not_an_applied_push(bounded):
    bounded.push([DenseGradient("w", _one())])
    bounded.push([DenseGradient("w", _one())])
    assert bounded.push([DenseGradient("w", _one(), version=0)]).rejected == ("w",)
    assert bounded.stats().applied_pushes == 2


def test_staleness_statistics_from_a_histogram():
    stats = StalenessStats.from_histogram({0: 98, 3: 1, 10: 1})
    assert stats.count == 100 and stats.max == 10 and stats.p99 == 3
    assert stats.mean == pytest.approx(0.13)
    assert StalenessStats.from_histogram({}) == StalenessStats(0, 0.0, 0, 0, {})
