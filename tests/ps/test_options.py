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
    ("max_staleness", -1), ("max_workers", 0),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        ServiceOptions(**{field: value})


def test_message_limit_must_hold_a_chunk():
    with pytest.raises(InvalidArgumentError, match="max_message_bytes"):
        ServiceOptions(chunk_bytes=4 << 20, max_message_bytes=4 << 20)
