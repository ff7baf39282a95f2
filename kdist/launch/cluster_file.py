"""Reads the `--cluster` file and `--task` values of `kdist launch`.

A deliberately small validator: the launcher only needs job names and
"host:port" addresses (read with kdist's one grammar,
`kdist.cluster.address.parse_address`) to hand each process its `TF_CONFIG`.
The process's own resolver (kdist.cluster) does the full validation when the
program starts.
"""

import json
import re

from kdist.cluster.address import parse_address
from kdist.cluster.resolvers import require_task_in_cluster
from kdist.errors import InvalidArgumentError

_TASK_PATTERN = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*):([0-9]+)$")


class ClusterFileError(InvalidArgumentError):
    """The `--cluster` file cannot be read or does not describe a cluster."""


def add_cluster_argument(group):
    """Adds `--cluster FILE` (read by `load_cluster`) to `group`: one definition for `kdist launch` and `kdist server`."""
    group.add_argument(
        "--cluster", metavar="FILE", help="JSON file with a TF_CONFIG cluster, or a whole TF_CONFIG"
    )


def load_cluster(path):
    """Returns the cluster dict (job -> list of "host:port") stored in `path`.

    The file holds either a whole `TF_CONFIG` object (its "cluster" key is used,
    any "task" is ignored) or just the cluster object.

    Raises:
        ClusterFileError: unreadable file, invalid JSON, or a malformed cluster;
            the message names the offending field.
    """
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except OSError as error:
        raise ClusterFileError(f"cannot read {path!r}: {error.strerror or error}.") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ClusterFileError(
            f"{path!r} is not valid JSON: {error.msg} at line {error.lineno} column {error.colno}."
        ) from None
    if not isinstance(data, dict):
        raise ClusterFileError(
            f'{path!r} must hold a JSON object: a TF_CONFIG with a "cluster" key, or the '
            f"cluster itself. Received: a JSON {type(data).__name__}."
        )
    field = "cluster"
    if "cluster" in data:
        data, field = data["cluster"], '["cluster"]'
    return validate_cluster(data, field, path)


def validate_cluster(cluster, field="cluster", path="the cluster file"):
    """Checks `cluster` is {job: ["host:port", ...]} and returns a plain copy.

    Raises:
        ClusterFileError: naming `field` and the offending key or index.
    """
    if not isinstance(cluster, dict) or not cluster:
        raise ClusterFileError(
            f"{field} in {path!r} must be a non-empty object mapping job names to lists of "
            f'"host:port" strings, like {{"worker": ["10.0.0.1:2222"]}}. Received: {cluster!r}.'
        )
    result = {}
    for job, addresses in cluster.items():
        where = f"{field}[{job!r}]"
        if not job or not _TASK_PATTERN.match(f"{job}:0"):
            raise ClusterFileError(
                f"job names in {path!r} must be identifiers like 'worker'. Received: {where}."
            )
        if not isinstance(addresses, list) or not addresses:
            raise ClusterFileError(
                f'{where} in {path!r} must be a non-empty list of "host:port" strings. '
                f"Received: {addresses!r}."
            )
        for index, address in enumerate(addresses):
            try:
                parse_address(address)
            except InvalidArgumentError:
                raise ClusterFileError(
                    f'{where}[{index}] in {path!r} must be a "host:port" string with a port in '
                    f"1..65535. Received: {address!r}."
                ) from None
        result[job] = list(addresses)
    return result


def parse_task(text):
    """Parses a `--task` value "TYPE:INDEX" into `(type, index)`.

    Raises:
        InvalidArgumentError: not of the form TYPE:INDEX.
    """
    match = _TASK_PATTERN.match(text)
    if match is None:
        raise InvalidArgumentError(
            f"expected TYPE:INDEX such as worker:0 or ps:1. Received: {text!r}."
        )
    return match.group(1), int(match.group(2))


def check_task(cluster, task_type, task_index):
    """Raises InvalidArgumentError unless `task_type:task_index` is a task of `cluster` (a `load_cluster` dict)."""
    require_task_in_cluster(cluster, task_type, task_index, received=f"{task_type}:{task_index}")
