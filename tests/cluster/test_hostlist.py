"""Tests for kdist.cluster.hostlist: Slurm's hostlist and tasks-per-node grammars.

The expansions are the ones Slurm documents: slurm.conf(5) (`linux[0-64,128]`,
`lx[15,18,32-33]`), slurm_hostlist_create(3) (`linux[1-3,6]`), the
Slurm::Hostlist(3pm) manual (`tux[0-5,12,20-25]`, `node1,node[2-5,12]`), and the
LLNL hostlist format Slurm shares with pdsh (`rack[01-3]-node[01-2,5]`,
`d[1-5],n[01-05]`).
"""

import pytest

from kdist.cluster.hostlist import MAX_HOSTS, expand_hostlist, expand_tasks_per_node
from kdist.errors import ClusterEnvironmentError, InvalidArgumentError


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("linux[0-64,128]", [f"linux{i}" for i in range(65)] + ["linux128"]),
        ("lx[15,18,32-33]", ["lx15", "lx18", "lx32", "lx33"]),
        ("linux[1-3,6]", ["linux1", "linux2", "linux3", "linux6"]),
        ("tux[0-5,12,20-25]", [f"tux{i}" for i in (0, 1, 2, 3, 4, 5, 12, 20, 21, 22, 23, 24, 25)]),
        ("node1,node[2-5,12]", ["node1", "node2", "node3", "node4", "node5", "node12"]),
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("d[1-5],n[01-05]", ["d1", "d2", "d3", "d4", "d5", "n01", "n02", "n03", "n04", "n05"]),
        ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
        (
            "rack[01-3]-node[01-2,5]",
            [f"rack0{r}-node{n}" for r in (1, 2, 3) for n in ("01", "02", "5")],
        ),
        ("linux[8-10]", ["linux8", "linux9", "linux10"]),  # width of the lower bound
        ("linux[08-10]", ["linux08", "linux09", "linux10"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),  # a suffix after the bracket
        ("127.0.0.1", ["127.0.0.1"]),
        ("localhost,127.0.0.1", ["localhost", "127.0.0.1"]),
        ("a b\tc", ["a", "b", "c"]),  # whitespace separates, as in Slurm
        ("  node7  ", ["node7"]),
        ("n[3,1,3]", ["n3", "n1", "n3"]),  # order and duplicates are kept
    ],
)
def test_documented_expansions(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "a,,b",
        ",a",
        "a,",
        "node[1-2",
        "node1-2]",
        "node[[1-2]]",
        "node[]",
        "node[2-1]",
        "node[a-b]",
        "node[1-]",
        "node[-1]",
        "node[1-2-3]",
        "node[1, 2]",
        "node[123x456]",  # Slurm's 3-D prisms are not node lists of a job step
        f"n[0-{MAX_HOSTS}]",
        "a[0-999]b[0-999]",
    ],
)
def test_malformed_hostlists_name_the_variable_and_value(text):
    with pytest.raises(ClusterEnvironmentError) as raised:
        expand_hostlist(text, "SLURM_STEP_NODELIST")
    assert raised.value.variable == "SLURM_STEP_NODELIST"
    assert raised.value.value == text
    assert f"SLURM_STEP_NODELIST={text!r}" in str(raised.value)
    assert isinstance(raised.value, InvalidArgumentError)


def test_the_largest_expansion_is_allowed():
    assert len(expand_hostlist(f"n[1-{MAX_HOSTS}]")) == MAX_HOSTS


@pytest.mark.parametrize(
    "text, counts",
    [
        ("4", [4]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("3(x2),2,1", [3, 3, 2, 1]),
        ("5,4(x3)", [5, 4, 4, 4]),
        ("1(x4)", [1, 1, 1, 1]),
    ],
)
def test_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "0", "2(x0)", "2(3)", "x2", "2,,1", "2(x3)1", "-1", "2.5"])
def test_malformed_tasks_per_node(text):
    with pytest.raises(ClusterEnvironmentError) as raised:
        expand_tasks_per_node(text)
    assert raised.value.variable == "SLURM_STEP_TASKS_PER_NODE"
    assert f"SLURM_STEP_TASKS_PER_NODE={text!r}" in str(raised.value)
