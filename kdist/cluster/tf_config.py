"""`TFConfigClusterResolver`: the cluster and task described by `TF_CONFIG`.

`TF_CONFIG` is a JSON object, set per process:

```json
{"cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"], "ps": ["p0:2222"]},
 "task": {"type": "worker", "index": 1},
 "rpc_layer": "grpc", "environment": "cloud"}
```

Unset, empty or `{}` means "no cluster". Unknown top-level keys are ignored
(launchers add their own); a key whose value is JSON `null` counts as absent.
"""

import json
import os
from collections.abc import Mapping

from kdist.cluster.address import parse_address
from kdist.cluster.resolvers import (
    ClusterResolver,
    check_task_types,
    format_master_url,
    validate_task,
)
from kdist.cluster.spec import ClusterSpec, field_item, normalize_cluster
from kdist.errors import InvalidArgumentError
from kdist.types import TaskType

TF_CONFIG = "TF_CONFIG"
_EXAMPLE = (
    'Expected a JSON object such as {"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
    '"task": {"type": "worker", "index": 0}}.'
)
# Long values are cut in messages so one error does not flood a log.
_MAX_RECEIVED_CHARS = 200
# Jobs that TensorFlow allows at most one task of.
_SINGLE_TASK_JOBS = (TaskType.CHIEF.value, TaskType.EVALUATOR.value)


def _short(value):
    text = repr(value)
    return text if len(text) <= _MAX_RECEIVED_CHARS else text[:_MAX_RECEIVED_CHARS] + "...'"


def load_tf_config(tf_config=None):
    """Returns `TF_CONFIG` as a dict, `{}` when it is unset or empty.

    Args:
        tf_config: the JSON text or an already-parsed dict; None reads the
            `TF_CONFIG` environment variable.

    Raises:
        kdist.errors.InvalidArgumentError: the text is not valid JSON (the
            message gives the position) or not a JSON object.
    """
    if tf_config is None:
        tf_config = os.environ.get(TF_CONFIG, "")
    if isinstance(tf_config, Mapping):
        return dict(tf_config)
    if not isinstance(tf_config, str):
        raise InvalidArgumentError(
            f"TF_CONFIG must be JSON text or a dict. Received: tf_config={_short(tf_config)}. "
            f"{_EXAMPLE}"
        )
    if not tf_config.strip():
        return {}
    try:
        config = json.loads(tf_config)
    except json.JSONDecodeError as error:
        raise InvalidArgumentError(
            f"TF_CONFIG is not valid JSON: {error.msg} at line {error.lineno}, column "
            f"{error.colno} (char {error.pos}). Received: TF_CONFIG={_short(tf_config)}. "
            f"{_EXAMPLE}"
        ) from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(
            f"TF_CONFIG must be a JSON object. Received: TF_CONFIG={_short(tf_config)}. "
            f"{_EXAMPLE}"
        )
    return config


def _optional_string(config, key):
    value = config.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidArgumentError(
            f"TF_CONFIG[{json.dumps(key)}] must be a string. "
            f"Received: TF_CONFIG[{json.dumps(key)}]={_short(value)}."
        )
    return value


def parse_tf_config_cluster(raw_cluster):
    """Validates `TF_CONFIG["cluster"]` strictly and returns it as a `ClusterSpec`.

    Beyond `ClusterSpec`'s checks: every job has at least one task, every
    address is `"host:port"` (see `parse_address`), and there is at most one
    chief and one evaluator.

    Raises:
        kdist.errors.InvalidArgumentError: naming the offending field, e.g.
            `TF_CONFIG["cluster"]["worker"][1]`.
    """
    field = f'{TF_CONFIG}["cluster"]'
    if raw_cluster is None:
        return ClusterSpec({})
    if not isinstance(raw_cluster, Mapping):
        raise InvalidArgumentError(
            f"{field} must be an object. Received: {field}={_short(raw_cluster)}. {_EXAMPLE}"
        )
    jobs = normalize_cluster(raw_cluster, field)
    for job, tasks in jobs.items():
        job_field = field_item(field, job)
        if not tasks:
            raise InvalidArgumentError(
                f"A job has no tasks. Received: {job_field}={_short(raw_cluster[job])}. "
                "Expected at least one 'host:port' address; leave the job out if it has "
                "no tasks."
            )
        if job in _SINGLE_TASK_JOBS and len(tasks) > 1:
            raise InvalidArgumentError(
                f"A cluster has at most one {job!r} task. "
                f"Received: {job_field}={_short(raw_cluster[job])}. "
                "Expected a single address; make the others 'worker' tasks."
            )
        for index, address in tasks.items():
            parse_address(address, field_item(job_field, index))
    return ClusterSpec(jobs)


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster and this process's task from `TF_CONFIG`.

    `TF_CONFIG` is parsed and validated once, at construction; later changes
    to the environment are not seen. Explicit arguments override the values in
    `TF_CONFIG`, as in TensorFlow. The chief is the `"chief"` task, or worker
    0 when the cluster has no chief.

    Args:
        task_type: this process's job name; overrides `TF_CONFIG["task"]["type"]`.
        task_id: this process's task index; overrides `TF_CONFIG["task"]["index"]`.
        rpc_layer: protocol prefix for `master()`; overrides `TF_CONFIG["rpc_layer"]`.
        environment: overrides `TF_CONFIG["environment"]`.
        tf_config: the configuration as JSON text or a dict; None reads the
            `TF_CONFIG` environment variable.

    Raises:
        kdist.errors.InvalidArgumentError: `TF_CONFIG` is malformed (the
            message names the field, e.g. `TF_CONFIG["task"]["index"]`), or
            the task does not exist in the cluster.

    Example:

    >>> os.environ["TF_CONFIG"] = json.dumps({
    ...     "cluster": {"chief": ["c:2222"], "worker": ["w0:2222", "w1:2222"]},
    ...     "task": {"type": "worker", "index": 1}})
    >>> resolver = TFConfigClusterResolver()
    >>> resolver.task_type, resolver.task_id, resolver.rendezvous().rank
    ('worker', 1, 2)
    """

    def __init__(
        self, task_type=None, task_id=None, rpc_layer=None, environment=None, tf_config=None
    ):
        check_task_types(task_type, task_id)
        for name, value in (("rpc_layer", rpc_layer), ("environment", environment)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(f"Expected a string. Received: {name}={value!r}.")
        config = load_tf_config(tf_config)
        config_environment = _optional_string(config, "environment")
        config_rpc_layer = _optional_string(config, "rpc_layer")
        self._cluster_spec = parse_tf_config_cluster(config.get("cluster"))
        task = config.get("task")
        task_field = f'{TF_CONFIG}["task"]'
        if task is None:
            task = {}
        elif not isinstance(task, Mapping):
            raise InvalidArgumentError(
                f"{task_field} must be an object. Received: {task_field}={_short(task)}. "
                f"{_EXAMPLE}"
            )
        type_field, id_field = f'{task_field}["type"]', f'{task_field}["index"]'
        check_task_types(task.get("type"), task.get("index"), type_field, id_field)
        if task and not self._cluster_spec:
            raise InvalidArgumentError(
                f'{TF_CONFIG}["cluster"] is missing or empty, but TF_CONFIG names a task. '
                f"Received: {task_field}={_short(task)}. Expected the cluster the task "
                f"belongs to. {_EXAMPLE}"
            )
        if self._cluster_spec:
            for key, explicit in (("type", task_type), ("index", task_id)):
                if explicit is None and task.get(key) is None:
                    missing = task_field if not task else f"{task_field}[{json.dumps(key)}]"
                    raise InvalidArgumentError(
                        f"{missing} is missing: TF_CONFIG has a cluster but does not say "
                        f"which task this process is. Received: {task_field}={_short(task)}. "
                        f'Expected e.g. "task": {{"type": "worker", "index": 0}}, or pass '
                        "task_type and task_id."
                    )
        self._task_type = task_type if task_type is not None else task.get("type")
        self._task_id = task_id if task_id is not None else task.get("index")
        validate_task(
            self._cluster_spec,
            self._task_type,
            self._task_id,
            "task_type" if task_type is not None else type_field,
            "task_id" if task_id is not None else id_field,
        )
        self._rpc_layer = rpc_layer if rpc_layer is not None else config_rpc_layer
        self._environment = (
            environment if environment is not None else (config_environment or "")
        )

    def cluster_spec(self):
        """Returns `TF_CONFIG["cluster"]` as a `ClusterSpec` (empty without one)."""
        return self._cluster_spec

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """Returns a task's address, this task's by default.

        Args:
            task_type: job of the task to address; this task's when None.
            task_id: index of the task to address; this task's when None.
            rpc_layer: protocol prefix; the resolver's `rpc_layer` when None.

        Returns:
            `"rpc_layer://host:port"`, `"host:port"` without an rpc layer, or
            `""` when no task is named and this process has none.

        Raises:
            kdist.errors.InvalidArgumentError: the named task is not in the
                cluster (an evaluator outside the cluster has no address).
        """
        task_type = task_type if task_type is not None else self._task_type
        task_id = task_id if task_id is not None else self._task_id
        if task_type is None or task_id is None:
            return ""
        address = self._cluster_spec.task_address(task_type, task_id)
        return format_master_url(address, rpc_layer or self._rpc_layer)
