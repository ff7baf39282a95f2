"""Tests for kdist.types: ReduceOp parsing and the Keras aggregation strings."""

import keras
import pytest

import kdist
from kdist.errors import InvalidArgumentError
from kdist.types import ReduceOp, TaskType, VariableAggregation


@pytest.mark.parametrize(
    "value, expected",
    [
        ("sum", ReduceOp.SUM),
        ("SUM", ReduceOp.SUM),
        ("Sum", ReduceOp.SUM),
        ("mean", ReduceOp.MEAN),
        ("MEAN", ReduceOp.MEAN),
        ("Mean", ReduceOp.MEAN),
        (ReduceOp.SUM, ReduceOp.SUM),
        (ReduceOp.MEAN, ReduceOp.MEAN),
    ],
)
def test_reduce_op_from_value_accepts_members_and_names_in_any_case(value, expected):
    assert ReduceOp.from_value(value) is expected


@pytest.mark.parametrize("value", ["max", "", "sum ", "ReduceOp.SUM", None, 0, 1.0])
def test_reduce_op_from_value_rejects_unknown_values(value):
    with pytest.raises(InvalidArgumentError) as info:
        ReduceOp.from_value(value)
    message = str(info.value)
    assert f"reduce_op={value!r}" in message
    assert "'sum'" in message and "'mean'" in message


def test_reduce_op_error_names_the_callers_argument_and_is_a_value_error():
    with pytest.raises(ValueError, match=r"Received: op='max'"):
        ReduceOp.from_value("max", argument_name="op")


def test_reduce_op_is_exported_at_top_level():
    assert kdist.ReduceOp is ReduceOp
    assert kdist.VariableAggregation is VariableAggregation


@pytest.mark.parametrize("member", list(VariableAggregation))
def test_variable_aggregation_values_are_keras_aggregation_strings(member):
    variable = keras.Variable(1.0, aggregation=member.value)
    assert variable.aggregation == member.value
    assert VariableAggregation(variable.aggregation) is member


def test_keras_default_aggregation_maps_to_none():
    assert VariableAggregation(keras.Variable(1.0).aggregation) is VariableAggregation.NONE


@pytest.mark.parametrize("candidate", ["max", "first", "replica", "MEAN"])
def test_strings_outside_the_enum_are_rejected_by_keras_too(candidate):
    # The enum and Keras agree in both directions: what the enum lacks, Keras refuses.
    assert candidate not in {member.value for member in VariableAggregation}
    with pytest.raises(ValueError):
        keras.Variable(1.0, aggregation=candidate)


def test_task_types_are_the_tf_config_job_names():
    assert {task.value for task in TaskType} == {"chief", "worker", "ps", "evaluator"}
    assert TaskType("ps") is TaskType.PS
