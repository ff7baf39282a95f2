"""Task addresses: the one grammar of `"host:port"` in kdist.

A task address is `"host:port"`: a host name or IPv4 address, or an IPv6
address in brackets (`"[::1]:2222"`), then a port. A *task's* port is in
1..65535; a server may *bind* port 0, which asks the operating system for a
free port. Everything that reads, writes or binds an address goes through
this module: `kdist.cluster` (cluster specs, resolvers), the servers of
`kdist.ps` and `kdist.coordinator`, `kdist.distribute.Server` and the
`kdist` command.

Glossary:

- **bind address**: where a server listens. `resolve_bind_address` turns
  what a user gives (nothing, a host, or `"host:port"`) into one.
- **wildcard host**: `0.0.0.0` or `::`, "every interface". A client on the
  same host reaches such a server through loopback (`connect_host`).
"""

import ipaddress
import re

from kdist.errors import InvalidArgumentError
from kdist.validation import is_integer

MAX_PORT = 65535
# Where a server listens unless told otherwise: reachable from this host only,
# so a cluster is never exposed to the network by accident.
DEFAULT_BIND_HOST = "127.0.0.1"
# Hosts that mean "every interface"; a client on this host reaches them through loopback.
_WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1"}
_PORT_PATTERN = re.compile(r"[0-9]+")


def is_port(value, allow_zero=False):
    """Whether `value` is a TCP port: an integer (not a bool) in 1..65535, or 0..65535 with `allow_zero`."""
    return is_integer(value, 0 if allow_zero else 1, MAX_PORT)


def split_address(address, field_name="address", allow_port_zero=False):
    """Like `parse_address`, optionally accepting port 0 ("any free port", for a server to bind)."""
    lowest_port = 0 if allow_port_zero else 1
    expected = (
        f"Expected 'host:port' with a port in {lowest_port}..{MAX_PORT}, e.g. "
        "'worker0.example.com:2222'; write IPv6 hosts in brackets, e.g. '[::1]:2222'."
    )
    if not isinstance(address, str) or not address:
        raise InvalidArgumentError(
            f"A task address must be a non-empty string. "
            f"Received: {field_name}={address!r}. {expected}"
        )
    if "://" in address:
        raise InvalidArgumentError(
            f"A cluster address takes no scheme; the protocol is the resolver's rpc_layer. "
            f"Received: {field_name}={address!r}. {expected}"
        )
    if address.startswith("["):
        host, bracket, rest = address[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            raise InvalidArgumentError(
                f"Malformed bracketed IPv6 address. Received: {field_name}={address!r}. "
                f"{expected}"
            )
        port_text = rest[1:]
    else:
        host, colon, port_text = address.rpartition(":")
        if not colon:
            raise InvalidArgumentError(
                f"The task address has no port. Received: {field_name}={address!r}. "
                f"{expected}"
            )
        if ":" in host:
            raise InvalidArgumentError(
                f"An IPv6 host must be written in brackets. "
                f"Received: {field_name}={address!r}. {expected}"
            )
    if not _is_host(host):
        raise InvalidArgumentError(
            f"The task address has an empty or malformed host. "
            f"Received: {field_name}={address!r}. {expected}"
        )
    if not _PORT_PATTERN.fullmatch(port_text):
        raise InvalidArgumentError(
            f"The port of a task address is not an integer. "
            f"Received: {field_name}={address!r}. {expected}"
        )
    port = int(port_text)
    if not is_port(port, allow_zero=allow_port_zero):
        raise InvalidArgumentError(
            f"The port of a task address is out of range. "
            f"Received: {field_name}={address!r}. {expected}"
        )
    return host, port


def parse_address(address, field_name="address"):
    """Splits a `"host:port"` task address into its host and port.

    Args:
        address: the address, e.g. `"worker0.example.com:2222"`, `"10.0.0.3:2222"`
            or, for IPv6, `"[::1]:2222"`.
        field_name: how error messages name the value, e.g.
            `'TF_CONFIG["cluster"]["worker"][1]'`.

    Returns:
        A tuple `(host, port)`: the host as a string (IPv6 hosts without their
        brackets, as `MASTER_ADDR` expects them) and the port as an int in
        1..65535.

    Raises:
        kdist.errors.InvalidArgumentError: `address` is not a string, has no
            port, a port that is not an integer or is out of range, an empty
            host, or an unbracketed IPv6 host.

    Example:

    >>> parse_address("worker0.example.com:2222")
    ('worker0.example.com', 2222)
    >>> parse_address("[::1]:2222")
    ('::1', 2222)
    """
    return split_address(address, field_name)


def format_address(host, port):
    """Joins a host and port into an address, bracketing IPv6 hosts.

    Example:

    >>> format_address("::1", 2222), format_address("10.0.0.3", 2222)
    ('[::1]:2222', '10.0.0.3:2222')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host):
    """True for `localhost` and loopback IP addresses (IPv6 with or without brackets)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def connect_host(host):
    """The host a client on this machine connects to for a server bound at `host`.

    The bound host itself, or loopback for a wildcard host (`0.0.0.0`, `::`).
    """
    return _WILDCARD_HOSTS.get(host, host)


def bind_endpoint(address, field_name="address"):
    """Splits the `"host:port"` a server binds; port 0 ("any free port") is allowed.

    Returns:
        `(host, port)`, the host without IPv6 brackets.

    Raises:
        kdist.errors.InvalidArgumentError: as `parse_address`, but with a port
            in 0..65535.
    """
    return split_address(address, field_name, allow_port_zero=True)


def resolve_bind_address(bind_address, task_port):
    """Returns the `"host:port"` to listen on.

    Args:
        bind_address: None (loopback), a host (`"0.0.0.0"`, `"::"`,
            `"[::]"`, `"10.0.0.2"`), or `"host:port"` (`"0.0.0.0:2222"`,
            `"[::]:2222"`).
        task_port: the task's port in the cluster, used when `bind_address`
            has none.

    Raises:
        kdist.errors.InvalidArgumentError: `bind_address` is not a string of
            one of those forms.

    Example:

    >>> resolve_bind_address(None, 2222), resolve_bind_address("::", 2222)
    ('127.0.0.1:2222', '[::]:2222')
    """
    if bind_address is None:
        return format_address(DEFAULT_BIND_HOST, task_port)
    expected = (
        "Expected a host such as '0.0.0.0' (the task's port is used) or 'host:port' such as "
        "'0.0.0.0:2222'; IPv6 as '::' or '[::]:2222'."
    )
    if not isinstance(bind_address, str) or not bind_address.strip():
        raise InvalidArgumentError(
            f"bind_address must be a non-empty string. Received: bind_address={bind_address!r}. "
            f"{expected}"
        )
    if bind_address.startswith("[") and bind_address.endswith("]"):
        host = bind_address[1:-1]
    elif bind_address.count(":") > 1 and not bind_address.startswith("["):
        host = bind_address  # A bare IPv6 address: no port.
    elif ":" in bind_address:
        return format_address(*bind_endpoint(bind_address, "bind_address"))
    else:
        host = bind_address
    if not _is_host(host) or any(character in "[]" for character in host):
        raise InvalidArgumentError(
            f"bind_address has a malformed host. Received: bind_address={bind_address!r}. "
            f"{expected}"
        )
    return format_address(host, task_port)


def _is_host(host):
    return bool(host) and not any(character.isspace() or character in "/@" for character in host)
