"""Tests for kdist.cluster.spec: ClusterSpec, addresses, and the package's import rule."""

import ast
import pathlib
import subprocess
import sys

import pytest

from kdist.cluster import ClusterSpec, parse_address
from kdist.errors import InvalidArgumentError

SEED_CLUSTER = {
    "chief": ["chief.example.com:2222"],
    "ps": ["ps0.example.com:2222", "ps1.example.com:2222"],
    "worker": [
        "worker0.example.com:2222",
        "worker1.example.com:2222",
        "worker2.example.com:2222",
    ],
}
CLUSTER_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "kdist" / "cluster"


def test_cluster_spec_round_trips_through_as_dict():
    spec = ClusterSpec(SEED_CLUSTER)
    assert spec.as_dict() == SEED_CLUSTER
    assert ClusterSpec(spec.as_dict()) == spec
    assert ClusterSpec(spec) == spec
    assert hash(ClusterSpec(SEED_CLUSTER)) == hash(spec)


def test_cluster_spec_queries():
    spec = ClusterSpec(SEED_CLUSTER)
    assert spec.jobs == ["chief", "ps", "worker"]
    assert spec.num_tasks("worker") == 3
    assert spec.task_indices("ps") == [0, 1]
    assert spec.task_address("worker", 2) == "worker2.example.com:2222"
    assert spec.job_tasks("ps") == SEED_CLUSTER["ps"]


def test_cluster_spec_is_immutable_and_as_dict_is_a_copy():
    spec = ClusterSpec(SEED_CLUSTER)
    copy = spec.as_dict()
    copy["worker"].append("extra:1")
    copy["evaluator"] = ["e:1"]
    assert spec == ClusterSpec(SEED_CLUSTER)
    with pytest.raises(AttributeError, match="immutable"):
        spec._jobs = {}
    source = {"worker": ["a:1"]}
    spec = ClusterSpec(source)
    source["worker"].append("b:1")
    assert spec.num_tasks("worker") == 1


def test_cluster_spec_accepts_tuples_and_compares_by_content():
    assert ClusterSpec({"worker": ("a:1", "b:1")}) == ClusterSpec({"worker": ["a:1", "b:1"]})
    assert ClusterSpec({"worker": ["a:1"]}) != ClusterSpec({"worker": ["b:1"]})
    assert ClusterSpec({"worker": ["a:1"]}) != {"worker": ["a:1"]}


def test_empty_cluster_spec_is_false():
    assert not ClusterSpec({})
    assert ClusterSpec({"worker": ["a:1"]})
    assert ClusterSpec({}).jobs == []
    assert ClusterSpec({}).as_dict() == {}


def test_sparse_worker_dict():
    spec = ClusterSpec({"worker": {1: "w1:2222", 3: "w3:2222"}, "chief": ["c:2222"]})
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [1, 3]
    assert spec.task_address("worker", 3) == "w3:2222"
    assert spec.job_tasks("worker") == [None, "w1:2222", None, "w3:2222"]
    assert spec.as_dict() == {"worker": {1: "w1:2222", 3: "w3:2222"}, "chief": ["c:2222"]}
    assert ClusterSpec(spec.as_dict()) == spec
    with pytest.raises(InvalidArgumentError, match=r"task_index=0.*\[1, 3\]"):
        spec.task_address("worker", 0)


def test_sparse_job_with_json_string_keys_equals_int_keys():
    assert ClusterSpec({"worker": {"0": "a:1", "2": "b:1"}}) == ClusterSpec(
        {"worker": {0: "a:1", 2: "b:1"}}
    )
    # A dense dict (keys 0..n-1) is the same cluster as a list.
    assert ClusterSpec({"worker": {"1": "b:1", "0": "a:1"}}).as_dict() == {
        "worker": ["a:1", "b:1"]
    }


def test_repr_can_be_evaluated_back():
    spec = ClusterSpec({"ps": ["p:1"], "worker": {2: "w:1"}})
    assert eval(repr(spec)) == spec  # noqa: S307 - our own repr of literals


def test_unknown_job_lists_the_known_jobs():
    spec = ClusterSpec(SEED_CLUSTER)
    known = r"job_name='evaluator'. Expected .*\['chief', 'ps', 'worker'\]"
    with pytest.raises(InvalidArgumentError, match=known):
        spec.num_tasks("evaluator")
    with pytest.raises(InvalidArgumentError, match="job_name='master'"):
        spec.task_address("master", 0)


@pytest.mark.parametrize("index", [3, -1, True, "0", None])
def test_task_index_out_of_range_is_an_error(index):
    with pytest.raises(InvalidArgumentError, match=r"task_index="):
        ClusterSpec(SEED_CLUSTER).task_address("worker", index)


def test_pseudo_addresses_are_accepted():
    spec = ClusterSpec({"worker": ["10.0.0.1:29500", "torchrun-rank-1"]})
    assert spec.task_address("worker", 1) == "torchrun-rank-1"


@pytest.mark.parametrize(
    "cluster, match",
    [
        ([("worker", ["a:1"])], r"Received: cluster=\["),
        ({"": ["a:1"]}, r"job name ''"),
        ({1: ["a:1"]}, r"job name 1"),
        ({"worker": "a:1"}, r'cluster\["worker"\]=\'a:1\''),
        ({"worker": ["a:1", ""]}, r'cluster\["worker"\]\[1\]=\'\''),
        ({"worker": ["a:1", 7]}, r'cluster\["worker"\]\[1\]=7'),
        ({"worker": ["a :1"]}, r"whitespace"),
        (
            {"worker": ["a:1", "a:1"]},
            r"cluster\[\"worker\"\]\[1\]='a:1', which is also cluster\[\"worker\"\]\[0\]",
        ),
        (
            {"chief": ["a:1"], "worker": ["a:1"]},
            r"cluster\[\"worker\"\]\[0\].*also cluster\[\"chief\"\]\[0\]",
        ),
        ({"worker": {-1: "a:1"}}, r"task index -1"),
        ({"worker": {"x": "a:1"}}, r"task index 'x'"),
        ({"worker": {"1": "a:1", 1: "b:1"}}, r"repeats"),
    ],
    ids=[
        "not-a-dict",
        "empty-job-name",
        "non-string-job-name",
        "job-not-a-list",
        "empty-address",
        "non-string-address",
        "whitespace-in-address",
        "duplicate-address-in-job",
        "duplicate-address-across-jobs",
        "negative-sparse-index",
        "non-integer-sparse-index",
        "repeated-sparse-index",
    ],
)
def test_malformed_cluster_specs(cluster, match):
    with pytest.raises(InvalidArgumentError, match=match) as info:
        ClusterSpec(cluster)
    assert isinstance(info.value, ValueError)
    assert "Received:" in str(info.value) and "Expected" in str(info.value)


@pytest.mark.parametrize(
    "address, expected",
    [
        ("worker0.example.com:2222", ("worker0.example.com", 2222)),
        ("10.0.0.3:1", ("10.0.0.3", 1)),
        ("localhost:65535", ("localhost", 65535)),
        ("[::1]:2222", ("::1", 2222)),
        ("[fe80::1%eth0]:8470", ("fe80::1%eth0", 8470)),
    ],
)
def test_parse_address_accepts_host_port(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize(
    "address, match",
    [
        ("worker0", "no port"),
        ("worker0:", "not an integer"),
        ("worker0:http", "not an integer"),
        ("worker0:+22", "not an integer"),
        ("worker0:0", "out of range"),
        ("worker0:65536", "out of range"),
        (":2222", "empty or malformed host"),
        ("grpc://worker0:2222", "scheme"),
        ("::1:2222", "IPv6 host must be written in brackets"),
        ("[::1]2222", "bracketed IPv6"),
        ("[::1", "bracketed IPv6"),
        ("", "non-empty string"),
        (2222, "non-empty string"),
    ],
)
def test_parse_address_rejects_malformed_addresses(address, match):
    with pytest.raises(InvalidArgumentError, match=match) as info:
        parse_address(address, 'TF_CONFIG["cluster"]["worker"][0]')
    assert 'Received: TF_CONFIG["cluster"]["worker"][0]=' in str(info.value)


def _imported_modules(path):
    """Yields (module name, is at module level) for every import in a file."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, id(node) in top_level
        elif isinstance(node, ast.ImportFrom):
            yield node.module, id(node) in top_level


@pytest.mark.parametrize("path", sorted(CLUSTER_PACKAGE.glob("*.py")), ids=lambda p: p.name)
def test_cluster_modules_import_only_stdlib_and_layer_zero(path):
    for module, at_top in _imported_modules(path):
        root = module.split(".")[0]
        if module in ("kdist.errors", "kdist.types", "kdist.validation") or module.startswith("kdist.cluster"):
            continue
        if root == "torch":
            assert not at_top, f"{path.name} imports torch at module level"
            continue
        assert root in sys.stdlib_module_names, f"{path.name} imports {module}"


def test_importing_kdist_cluster_loads_neither_keras_nor_torch():
    # A stub parent package keeps kdist/__init__.py (which imports Keras) out of the way.
    code = (
        "import sys, types\n"
        "package = types.ModuleType('kdist')\n"
        f"package.__path__ = [{str(CLUSTER_PACKAGE.parent)!r}]\n"
        "sys.modules['kdist'] = package\n"
        "import kdist.cluster\n"
        "kdist.cluster.resolve_cluster(environ={}).rendezvous()\n"
        "print(sorted(m for m in ('keras', 'torch') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "[]"
