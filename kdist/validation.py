"""Argument checks shared by every layer (layer 0: imports only `kdist.errors`).

kdist refuses bad arguments before it changes any state, with an
`InvalidArgumentError` that names the argument, what was received and what
was expected. The predicates here say what "an integer" and "a number of
seconds" mean once for the whole package (`True` is not an integer here,
though Python says it is; NumPy integers are), and `require_*` raise the one
message format:

    <name> must be <expected>. Received: <name>=<value!r>.

Callers whose message says more (which option, which class) build it
themselves from the predicates and still raise `InvalidArgumentError`.
"""

import math
import numbers

from kdist.errors import InvalidArgumentError


def is_integer(value, minimum=None, maximum=None):
    """Whether `value` is an integer (not a bool) within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return False
    return (minimum is None or value >= minimum) and (maximum is None or value <= maximum)


def is_seconds(value, allow_zero=False, allow_infinite=False):
    """Whether `value` is a positive number of seconds (0 too with `allow_zero`, inf with `allow_infinite`)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        return False
    if math.isinf(value) and not allow_infinite:
        return False
    return value > 0 or (allow_zero and value == 0)


def invalid(name, value, expected, error=InvalidArgumentError):
    """The standard error for argument `name`: it received `value` and expected `expected`."""
    return error(f"{name} must be {expected}. Received: {name}={value!r}.")


def require_integer(name, value, minimum=None, maximum=None, allow_none=False, expected=None):
    """Returns `value` as an int, or raises `InvalidArgumentError` naming `name`.

    Args:
        name: the argument's name, as the caller's signature spells it.
        value: what was received.
        minimum, maximum: inclusive bounds; None for no bound.
        allow_none: None passes through (returned as None).
        expected: the words for what is expected; by default derived from the bounds.
    """
    if value is None and allow_none:
        return None
    if is_integer(value, minimum, maximum):
        return int(value)
    if expected is None:
        expected = _integer_words(minimum, maximum) + (" or None" if allow_none else "")
    raise invalid(name, value, expected)


def require_positive_integer(name, value, allow_none=False):
    """`require_integer` with minimum 1."""
    return require_integer(name, value, minimum=1, allow_none=allow_none)


def require_seconds(name, value, allow_zero=False, allow_infinite=False, allow_none=False):
    """Returns `value` as a float number of seconds, or raises `InvalidArgumentError` naming `name`."""
    if value is None and allow_none:
        return None
    if is_seconds(value, allow_zero, allow_infinite):
        return float(value)
    bound = "a non-negative" if allow_zero else "a positive"
    finite = "" if allow_infinite else ", finite"
    raise invalid(name, value, f"{bound}{finite} number of seconds" + (" or None" if allow_none else ""))


def _integer_words(minimum, maximum):
    if minimum == 1 and maximum is None:
        return "a positive integer"
    if minimum == 0 and maximum is None:
        return "a non-negative integer"
    if minimum is None and maximum is None:
        return "an integer"
    if maximum is None:
        return f"an integer >= {minimum}"
    if minimum is None:
        return f"an integer <= {maximum}"
    return f"an integer in [{minimum}, {maximum}]"
