"""ServiceOptions validation."""

import pytest

from kdist.errors import InvalidArgumentError
from kdist.ps import ServiceOptions
from kdist.ps.options import FRAMING_BYTES


def test_defaults_are_consistent():
    options = ServiceOptions()
    assert options.max_message_bytes >= options.chunk_bytes + FRAMING_BYTES
    assert options.max_staleness is None


@pytest.mark.parametrize("field, value", [
    ("chunk_bytes", 0), ("chunk_bytes", 1.5), ("chunk_bytes", True),
    ("max_message_bytes", 1 << 31), ("rpc_timeout_seconds", 0),
    ("rpc_timeout_seconds", float("inf")), ("connect_timeout_seconds", -1),
    ("max_staleness", -1), ("max_workers", 0), ("max_workers", 1),
    ("max_concurrent_streams", 0), ("max_concurrent_streams", 16),
    ("max_streams_per_peer", 0), ("stream_idle_seconds", 0),
    ("stream_idle_seconds", float("nan")), ("allow_non_finite_gradients", 1),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        ServiceOptions(**{field: value})


def test_message_limit_must_hold_a_chunk():
    with pytest.raises(InvalidArgumentError, match="max_message_bytes"):
        ServiceOptions(chunk_bytes=4 << 20, max_message_bytes=4 << 20)


def test_stream_bounds_leave_threads_for_unary_calls():
    assert ServiceOptions().stream_limit == 12 and ServiceOptions().peer_stream_limit == 8
    assert ServiceOptions(max_workers=4).stream_limit == 2
    assert ServiceOptions(max_workers=2).stream_limit == 1
    assert ServiceOptions(max_workers=64, max_concurrent_streams=40).stream_limit == 40
    assert ServiceOptions(max_workers=8, max_streams_per_peer=100).peer_stream_limit == 4
    assert ServiceOptions().stream_idle_seconds == 30.0
    assert ServiceOptions().allow_non_finite_gradients is False
