"""Tests for kdist.launch.cluster_file: the `--cluster` file's checks agree with kdist.cluster."""

import pytest

from kdist.cluster.address import parse_address
from kdist.errors import InvalidArgumentError
from kdist.launch.cluster_file import ClusterFileError, check_task, validate_cluster

ADDRESSES = [
    "h:1", "10.0.0.1:65535", "[::1]:2222", "worker-0.example.com:2222",
    # Refused by the launcher's own parser and by the one grammar alike:
    "h:0", "h:65536", "nope", "h:", ":2222", 5,
    # Accepted by the launcher's former own parser, refused by every kdist resolver later
    # ("h:²" crashed it with a bare ValueError):
    "::1:2222", "a b:1", "http://h:1", "h:²",
]


def _parses(address):
    try:
        parse_address(address)
    except InvalidArgumentError:
        return False
    return True


@pytest.mark.parametrize("address", ADDRESSES)
def test_a_cluster_file_takes_exactly_the_addresses_of_the_one_grammar(address):
    cluster = {"worker": ["h0:2222", address]}
    if _parses(address):
        assert validate_cluster(cluster) == cluster
    else:
        with pytest.raises(ClusterFileError, match=r"cluster\['worker'\]\[1\] .*host:port"):
            validate_cluster(cluster)


def test_check_task_names_the_job_or_the_range():
    cluster = {"worker": ["h0:2222", "h1:2222"]}
    check_task(cluster, "worker", 1)
    with pytest.raises(InvalidArgumentError, match=r"^job 'ps' is not in the cluster\. Received: ps:0\."):
        check_task(cluster, "ps", 0)
    with pytest.raises(InvalidArgumentError, match=r"^job 'worker' has 2 task\(s\).*Received: worker:2\..*\[0, 1\]"):
        check_task(cluster, "worker", 2)
