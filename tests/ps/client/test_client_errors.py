"""`ParameterServerUnavailableError` states how long the client really tried."""

import time

import pytest

from kdist.errors import ParameterServerUnavailableError
from kdist.launch.ports import free_port
from kdist.ps import VariableClient


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
