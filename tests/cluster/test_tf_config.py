"""Tests for kdist.cluster.tf_config: parsing and validating TF_CONFIG."""

import json

import pytest

from kdist.cluster import ClusterSpec, TFConfigClusterResolver
from kdist.errors import InvalidArgumentError

# The cluster of the ParameterServerStrategy seed page: 1 chief, 2 ps, 3 workers.
SEED_CLUSTER = {
    "chief": ["chief.example.com:2222"],
    "ps": ["ps0.example.com:2222", "ps1.example.com:2222"],
    "worker": [
        "worker0.example.com:2222",
        "worker1.example.com:2222",
        "worker2.example.com:2222",
    ],
}


def seed_config(task_type, index):
    return json.dumps({"cluster": SEED_CLUSTER, "task": {"type": task_type, "index": index}})


def test_seed_example_ps_task(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", seed_config("ps", 1))
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec(SEED_CLUSTER)
    assert (resolver.task_type, resolver.task_id) == ("ps", 1)
    assert not resolver.is_chief
    assert resolver.master() == "ps1.example.com:2222"
    assert resolver.environment == "" and resolver.rpc_layer is None


@pytest.mark.parametrize("task_type, index", [("chief", 0), ("worker", 0), ("worker", 2)])
def test_chief_is_the_chief_task_when_there_is_one(task_type, index):
    resolver = TFConfigClusterResolver(tf_config=seed_config(task_type, index))
    assert resolver.is_chief == (task_type == "chief")


def test_worker_zero_is_chief_without_a_chief_job():
    cluster = {"worker": ["w0:1", "w1:1"], "ps": ["p:1"]}
    for index, expected in ((0, True), (1, False)):
        config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        assert TFConfigClusterResolver(tf_config=config).is_chief is expected


@pytest.mark.parametrize("value", [None, "", "   ", "{}"])
def test_unset_or_empty_tf_config_means_no_cluster(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", value)
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec({}) and not resolver.cluster_spec()
    assert resolver.task_type is None and resolver.task_id is None
    assert resolver.master() == ""
    assert resolver.is_chief


def test_tf_config_is_read_once_at_construction(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", seed_config("worker", 1))
    resolver = TFConfigClusterResolver()
    monkeypatch.setenv("TF_CONFIG", seed_config("worker", 2))
    assert resolver.task_id == 1


def test_tf_config_argument_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", seed_config("worker", 1))
    resolver = TFConfigClusterResolver(tf_config=seed_config("ps", 0))
    assert resolver.task_type == "ps"


def test_explicit_task_overrides_tf_config():
    resolver = TFConfigClusterResolver(
        task_type="worker", task_id=2, tf_config=seed_config("ps", 1)
    )
    assert (resolver.task_type, resolver.task_id) == ("worker", 2)
    assert resolver.master() == "worker2.example.com:2222"
    only_id = TFConfigClusterResolver(task_id=0, tf_config=seed_config("ps", 1))
    assert (only_id.task_type, only_id.task_id) == ("ps", 0)


def test_explicit_task_can_stand_in_for_a_missing_task():
    resolver = TFConfigClusterResolver(
        task_type="chief", task_id=0, tf_config={"cluster": SEED_CLUSTER}
    )
    assert resolver.is_chief


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"task_type": "master", "task_id": 0}, r"Received: task_type='master'"),
        ({"task_type": "worker", "task_id": 3}, r"Received: task_id=3"),
        ({"task_id": True}, r"Received: task_id=True"),
        ({"rpc_layer": 1}, r"Received: rpc_layer=1"),
    ],
)
def test_bad_explicit_arguments_are_named(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        TFConfigClusterResolver(tf_config=seed_config("ps", 1), **kwargs)


def test_rpc_layer_and_environment(monkeypatch):
    config = json.loads(seed_config("worker", 1))
    config.update(rpc_layer="grpc", environment="cloud", trial="1")  # unknown keys ignored
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    resolver = TFConfigClusterResolver()
    assert resolver.environment == "cloud"
    assert resolver.master() == "grpc://worker1.example.com:2222"
    assert resolver.master("ps", 0) == "grpc://ps0.example.com:2222"
    assert resolver.master("chief", 0, rpc_layer="tcp") == "tcp://chief.example.com:2222"
    overridden = TFConfigClusterResolver(rpc_layer="", environment="google")
    assert overridden.master() == "worker1.example.com:2222"
    assert overridden.environment == "google"


def test_sparse_workers_and_ipv6_addresses():
    config = {
        "cluster": {"worker": {"0": "[::1]:2222", "2": "[::1]:2223"}},
        "task": {"type": "worker", "index": 2},
    }
    resolver = TFConfigClusterResolver(tf_config=config)
    assert resolver.cluster_spec().task_indices("worker") == [0, 2]
    assert resolver.master() == "[::1]:2223"


def test_evaluator_may_run_outside_the_cluster():
    config = {"cluster": SEED_CLUSTER, "task": {"type": "evaluator", "index": 0}}
    resolver = TFConfigClusterResolver(tf_config=config)
    assert resolver.task_type == "evaluator"
    assert not resolver.is_chief


ONE_WORKER = {"worker": ["a:1"]}
CLUSTER = r'TF_CONFIG\["cluster"\]'
TASK = r'TF_CONFIG\["task"\]'


def with_task(task_type="worker", index=0, cluster=None):
    return {"cluster": cluster or ONE_WORKER, "task": {"type": task_type, "index": index}}


# Each case: the TF_CONFIG text or object, and a regex naming the offending field.
_MALFORMED = [
    pytest.param(
        '{"cluster": {', r"not valid JSON: .* line 1, column 14 \(char 13\)", id="bad-json"
    ),
    pytest.param('{"cluster": {},}', r"not valid JSON: .*column 16", id="trailing-comma"),
    pytest.param('["worker"]', r"must be a JSON object\. Received: TF_CONFIG=", id="top-list"),
    pytest.param("null", r"must be a JSON object", id="top-null"),
    pytest.param(
        {"task": {"type": "worker", "index": 0}}, CLUSTER + " is missing", id="missing-cluster"
    ),
    pytest.param({"cluster": ["a:1"]}, CLUSTER + " must be an object", id="cluster-not-object"),
    pytest.param(
        {"cluster": {"worker": "a:1"}}, rf"Received: {CLUSTER}\[\"worker\"\]='a:1'", id="job-str"
    ),
    pytest.param(
        {"cluster": {"ps": [], "worker": ["a:1"]}},
        rf"no tasks\. Received: {CLUSTER}\[\"ps\"\]=\[\]",
        id="empty-job",
    ),
    pytest.param(
        {"cluster": {"worker": ["a:1", 2222]}},
        rf"Received: {CLUSTER}\[\"worker\"\]\[1\]=2222",
        id="non-string-address",
    ),
    pytest.param(
        {"cluster": {"worker": ["a:1", "b"]}},
        rf"no port\. Received: {CLUSTER}\[\"worker\"\]\[1\]='b'",
        id="address-without-port",
    ),
    pytest.param(
        {"cluster": {"worker": ["a:x"]}},
        rf"not an integer\. Received: {CLUSTER}\[\"worker\"\]\[0\]='a:x'",
        id="non-integer-port",
    ),
    pytest.param(
        {"cluster": {"ps": ["a:70000"]}},
        rf"out of range\. Received: {CLUSTER}\[\"ps\"\]\[0\]='a:70000'",
        id="port-out-of-range",
    ),
    pytest.param(
        {"cluster": {"ps": ["a:0"]}},
        rf"out of range\. Received: {CLUSTER}\[\"ps\"\]\[0\]='a:0'",
        id="port-zero",
    ),
    pytest.param(
        {"cluster": {"chief": ["a:1"], "worker": ["b:1", "a:1"]}},
        rf"{CLUSTER}\[\"worker\"\]\[1\]='a:1', which is also {CLUSTER}\[\"chief\"\]\[0\]",
        id="duplicate-address-across-jobs",
    ),
    pytest.param(
        {"cluster": {"chief": ["a:1", "b:1"]}},
        rf"at most one 'chief'.*{CLUSTER}\[\"chief\"\]",
        id="two-chiefs",
    ),
    pytest.param({"cluster": ONE_WORKER}, TASK + " is missing", id="missing-task"),
    pytest.param(
        {"cluster": ONE_WORKER, "task": "worker"}, TASK + " must be an object", id="task-str"
    ),
    pytest.param(
        {"cluster": ONE_WORKER, "task": {"index": 0}},
        rf"{TASK}\[\"type\"\] is missing",
        id="task-missing-type",
    ),
    pytest.param(
        {"cluster": ONE_WORKER, "task": {"type": "worker"}},
        rf"{TASK}\[\"index\"\] is missing",
        id="task-missing-index",
    ),
    pytest.param(
        with_task("master"),
        rf"Received: {TASK}\[\"type\"\]='master'. Expected .*\['worker'\]",
        id="unknown-task-type",
    ),
    pytest.param(with_task(1), rf"Received: {TASK}\[\"type\"\]=1", id="non-string-type"),
    pytest.param(with_task(index="0"), rf"Received: {TASK}\[\"index\"\]='0'", id="string-index"),
    pytest.param(with_task(index=True), rf"Received: {TASK}\[\"index\"\]=True", id="bool-index"),
    pytest.param(with_task(index=-1), rf"Received: {TASK}\[\"index\"\]=-1", id="negative-index"),
    pytest.param(with_task(index=0.0), rf"Received: {TASK}\[\"index\"\]=0\.0", id="float-index"),
    pytest.param(
        with_task(index=2, cluster={"worker": ["a:1", "b:1"]}),
        rf"Received: {TASK}\[\"index\"\]=2\. Expected .*\[0, 1\]",
        id="index-out-of-range",
    ),
    pytest.param(
        {"environment": 1}, r'Received: TF_CONFIG\["environment"\]=1', id="environment-not-str"
    ),
    pytest.param(
        {"rpc_layer": ["grpc"]},
        r"Received: TF_CONFIG\[\"rpc_layer\"\]=\['grpc'\]",
        id="rpc-layer-not-str",
    ),
]


@pytest.mark.parametrize("tf_config, match", _MALFORMED)
def test_malformed_tf_config_names_the_field(monkeypatch, tf_config, match):
    text = tf_config if isinstance(tf_config, str) else json.dumps(tf_config)
    monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(InvalidArgumentError, match=match) as info:
        TFConfigClusterResolver()
    assert isinstance(info.value, ValueError)
    assert "Received: " in str(info.value)


def test_tf_config_argument_of_the_wrong_type():
    with pytest.raises(InvalidArgumentError, match=r"Received: tf_config=42"):
        TFConfigClusterResolver(tf_config=42)


def test_long_tf_config_is_shortened_in_the_message():
    text = '{"cluster": ' + " " * 1000 + "oops"
    with pytest.raises(InvalidArgumentError) as info:
        TFConfigClusterResolver(tf_config=text)
    assert len(str(info.value)) < 600
