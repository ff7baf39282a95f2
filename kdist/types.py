"""Small enums shared by every layer of kdist."""

import enum


class ReduceOp(enum.Enum):
    """How values from several replicas are combined.

    `SUM` adds them; `MEAN` divides the sum by the number of contributions
    (replicas, or elements along `axis` in `Strategy.reduce`).

    Strings are accepted wherever a `ReduceOp` is, case-insensitively:
    `strategy.reduce("sum", value, axis=None)`.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_value(cls, value, argument_name="reduce_op"):
        """Returns the `ReduceOp` for a `ReduceOp` or a string like `"mean"`.

        Raises:
            kdist.errors.InvalidArgumentError: `value` names no reduction.
        """
        from kdist.errors import InvalidArgumentError

        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise InvalidArgumentError(
            f"Unknown reduction. Received: {argument_name}={value!r}. "
            "Expected kdist.ReduceOp.SUM, kdist.ReduceOp.MEAN, or one of the "
            "strings 'sum' and 'mean' (any case)."
        )


class VariableAggregation(enum.Enum):
    """How the copies of a variable held by several replicas are combined.

    The values are the strings Keras uses for `Variable(aggregation=...)`, so
    `VariableAggregation(variable.aggregation)` works on any Keras variable.
    """

    NONE = "none"
    SUM = "sum"
    MEAN = "mean"
    ONLY_FIRST_REPLICA = "only_first_replica"


class TaskType(enum.Enum):
    """Roles of the tasks in a cluster (the job names of `TF_CONFIG`)."""

    CHIEF = "chief"
    WORKER = "worker"
    PS = "ps"
    EVALUATOR = "evaluator"
