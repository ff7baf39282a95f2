"""Closing a kdist channel while other threads start calls on it never crashes.

grpcio segfaults when a method is first registered on a closed channel (a
dispatcher thread's first `Define` racing `shutdown()` killed a whole CI run).
`Security.channel` returns a `GuardedChannel` that serializes the two; the raw
channel is the negative control and must still crash, or the test proves nothing.
"""

import signal
from pathlib import Path

import pytest

from kdist.rpc.guarded_channel import CLOSED_MESSAGE, GuardedChannel
from kdist.rpc.security import Security
from tests import harness
from tests.rpc.echo_fixture import SERVICE, call, serve  # noqa: F401 (serve is a fixture)

SCRIPT = Path(__file__).with_name("close_race_main.py")


def _run_child(*args):
    specs = harness.python_specs([("child", {})], SCRIPT, *args)
    return harness.run(specs, timeout=90)


@pytest.mark.parametrize("secret", [None, "race-secret"], ids=["insecure", "authenticated"])
def test_closing_while_threads_start_calls_is_survived(secret):
    result = _run_child("guarded", *([secret] if secret else []))
    result.check()
    assert "survived" in result.output("child", "stdout")


def test_negative_control_the_raw_channel_crashes_grpc():
    result = _run_child("raw")
    assert result.returncodes["child"] == -signal.SIGSEGV, result.output("child")


def test_a_closed_channel_refuses_new_calls_with_grpcs_error(serve):
    server = serve(Security.insecure())
    channel = Security.insecure().channel(f"127.0.0.1:{server.port}")
    assert isinstance(channel, GuardedChannel)
    assert call(channel, "Unary") == b"ping"
    channel.close()
    assert channel.closed
    for method in ("Unary", "UnaryStream", "StreamUnary", "StreamStream"):
        with pytest.raises(ValueError, match=CLOSED_MESSAGE):
            call(channel, method)
    channel.close()


def test_authenticated_channel_still_works_and_closes(serve):
    security = Security(token="guarded-secret")
    server = serve(security)
    with security.channel(f"127.0.0.1:{server.port}") as channel:
        assert call(channel, "Unary") == b"ping"
        assert call(channel, "StreamStream") == b"pingping"
    # The same error as without the secret, which callers read as "shut down meanwhile".
    with pytest.raises(ValueError, match=CLOSED_MESSAGE):
        channel.unary_unary(f"/{SERVICE}/Unary", _registered_method=True)(b"x", timeout=5)
