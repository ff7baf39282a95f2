"""Free TCP ports for local clusters and rendezvous addresses."""

import contextlib
import socket

from kdist.errors import InvalidArgumentError


def free_ports(num_ports, host="127.0.0.1"):
    """Returns `num_ports` distinct TCP ports that are free on `host` right now.

    Every port is bound (port 0, chosen by the kernel) and all sockets stay open
    until the last one is chosen, so the ports are distinct; then they are closed.
    Another program may still take a port before the caller binds it: use the
    ports at once (the usual race of this technique, accepted by torchrun too).

    Args:
        num_ports: how many ports, at least 1.
        host: the address to bind; it must be an address of this machine.

    Returns:
        A list of `num_ports` distinct port numbers.

    Raises:
        kdist.errors.InvalidArgumentError: `num_ports` < 1.
        OSError: `host` is not an address of this machine.

    Example:
        >>> chief_port, worker_port = free_ports(2)
    """
    if num_ports < 1:
        raise InvalidArgumentError(
            f"free_ports needs at least one port. Received: num_ports={num_ports}."
        )
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(num_ports):
            sock = stack.enter_context(socket.socket(_family(host), socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def free_port(host="127.0.0.1"):
    """Returns one free TCP port on `host` (see `free_ports`)."""
    return free_ports(1, host)[0]


def _family(host):
    return socket.AF_INET6 if ":" in host else socket.AF_INET
