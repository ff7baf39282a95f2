"""Fixtures: a real variable-service server on a free loopback port, and clients of it."""

import keras
import numpy as np
import pytest

from kdist.ps import ServiceOptions, VariableClient, create_server

# Odd and small, so that even small test tensors stream in several chunks that
# straddle tensor boundaries.
SMALL_CHUNK_BYTES = 1000


def sgd_config(learning_rate=0.1, **kwargs):
    return keras.optimizers.serialize(keras.optimizers.SGD(learning_rate, **kwargs))


@pytest.fixture
def options():
    return ServiceOptions(chunk_bytes=SMALL_CHUNK_BYTES, rpc_timeout_seconds=30,
                          connect_timeout_seconds=10)


@pytest.fixture
def server(options):
    server = create_server(options=options)
    yield server
    server.stop(0)


@pytest.fixture
def client(server, options):
    with VariableClient(server.address, options=options) as client:
        yield client


@pytest.fixture
def rng():
    return np.random.default_rng(0)
