"""`ParameterServerUnavailableError` states how long the client really tried."""

import threading
import time

import numpy as np
import pytest

from kdist.errors import ParameterServerUnavailableError
from kdist.launch.ports import free_port
from kdist.ps import ServiceOptions, VariableClient, VariableInit, create_server


def test_unavailable_error_states_the_real_elapsed_time():
    with VariableClient(f"127.0.0.1:{free_port()}") as client:
        started = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError) as caught:
            client.wait_until_ready(timeout=1.5)
        elapsed = time.monotonic() - started
    error = caught.value
    assert error.elapsed_seconds == pytest.approx(elapsed, abs=0.5)
    assert f"after trying for {error.elapsed_seconds:.1f} seconds" in str(error)
    assert "(deadline 1.5 seconds)" in str(error)


def test_message_without_elapsed_time_is_unchanged():
    assert "within 3 seconds" in str(ParameterServerUnavailableError("h:1", 3.0))


def test_give_up_ends_a_call_waiting_for_its_server_to_come_back():
    server = create_server()
    options = ServiceOptions(rpc_timeout_seconds=60, recovery_timeout_seconds=60)
    with VariableClient(server.address, options=options) as client:
        client.create([VariableInit("w", np.zeros(3, "float32"))])
        server.stop(0)
        threading.Timer(1.0, client.give_up).start()
        started = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError, match="did not come back") as raised:
            client.pull(["w"])  # would wait up to 60 s for the server to return
        assert time.monotonic() - started < 10
        assert raised.value.address == server.address
        # Later calls fail at once.
        started = time.monotonic()
        with pytest.raises(ParameterServerUnavailableError):
            client.pull(["w"])
        assert time.monotonic() - started < 5
