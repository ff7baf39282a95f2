"""Tests for kdist.launch.ports."""

import socket

import pytest

from kdist.errors import InvalidArgumentError
from kdist.launch.ports import free_port, free_ports


def test_free_ports_are_distinct_and_bindable():
    ports = free_ports(5)

    assert len(set(ports)) == 5
    for port in ports:
        with socket.create_server(("127.0.0.1", port)):
            pass
    assert 0 < free_port() < 65536


def test_free_ports_needs_at_least_one():
    with pytest.raises(InvalidArgumentError, match="num_ports=0"):
        free_ports(0)


def test_free_ports_on_a_foreign_address_raises_os_error():
    with pytest.raises(OSError):
        free_ports(1, host="192.0.2.1")  # TEST-NET-1: never an address of this host.
