"""`Server` as in TensorFlow: serves until `stop()` even when dropped; `protocol` and `config`."""

import gc

import pytest

import kdist
from kdist.distribute import server as server_module
from kdist.errors import InvalidArgumentError, UnsupportedError
from kdist.ps import VariableClient


def test_a_dropped_server_keeps_serving_until_stopped():
    target = kdist.distribute.Server.create_local_server().target  # the object is dropped at once
    gc.collect()
    with VariableClient(target) as client:
        assert client.wait_until_ready(timeout=10)["status"]
    [server] = [server for server in server_module._serving if server.target == target]
    server.stop(0)
    assert server not in server_module._serving and not server.started


@pytest.mark.parametrize("protocol", [None, "grpc"])
def test_protocol_grpc_and_config_none_are_accepted(protocol):
    server = kdist.distribute.Server({"ps": ["127.0.0.1:0"]}, "ps", 0, protocol=protocol, config=None, start=False)
    assert server.protocol == "grpc"


def test_other_protocols_and_configs_are_refused_naming_the_argument():
    spec = {"ps": ["127.0.0.1:0"]}
    with pytest.raises(UnsupportedError, match="protocol='grpc\\+verbs'"):
        kdist.distribute.Server(spec, "ps", 0, protocol="grpc+verbs")
    with pytest.raises(InvalidArgumentError, match="protocol=3"):
        kdist.distribute.Server(spec, "ps", 0, protocol=3)
    with pytest.raises(UnsupportedError, match="config"):
        kdist.distribute.Server(spec, "ps", 0, config={"inter_op_parallelism_threads": 4})
    assert not server_module._serving or all(server.started for server in server_module._serving)
