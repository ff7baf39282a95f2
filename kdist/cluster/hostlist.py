"""Slurm's compact lists: hostlist expressions and tasks-per-node counts.

A *hostlist expression* names many hosts at once, as Slurm writes
`SLURM_STEP_NODELIST`:

- expressions are separated by commas (or whitespace) outside brackets:
  `a[1-2],b3` is `a1, a2, b3`;
- a bracket holds comma-separated numbers and inclusive ranges:
  `lx[15,18,32-33]` is `lx15, lx18, lx32, lx33`;
- a range keeps the width of its lower bound, zero-padded:
  `node[01-04,07]` is `node01 ... node04, node07`, while `linux[8-10]` is
  `linux8, linux9, linux10`;
- several brackets in one expression multiply out, the first varying
  slowest: `rack[1-2]-node[01-02]` is `rack1-node01, rack1-node02,
  rack2-node01, rack2-node02`.

Order is kept and duplicates are not removed, as in Slurm. A *tasks-per-node*
list is Slurm's `SLURM_STEP_TASKS_PER_NODE`: `2(x3),1` is `[2, 2, 2, 1]`.
"""

import re

from kdist.errors import ClusterEnvironmentError

# A bound on one expansion, so that `n[0-999999999]` is refused instead of
# exhausting memory. Slurm caps one range at 64K hosts too.
MAX_HOSTS = 65536
_RANGE_PATTERN = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_TASKS_PATTERN = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")
_SEPARATORS = (",", " ", "\t", "\n")


def _error(variable, text, problem, expected):
    return ClusterEnvironmentError(
        f"Malformed {problem}. Received: {variable}={text!r}. Expected {expected}.",
        variable,
        text,
    )


_HOSTLIST_EXPECTED = (
    "a Slurm hostlist such as 'node[01-04,07]', 'lx[15,18,32-33]' or 'a[1-2],b3': "
    "host names, each with optional bracketed lists of numbers and increasing ranges"
)


def _split_expressions(text, variable):
    """Splits at separators outside brackets; refuses unbalanced or nested brackets.

    Whitespace separates like a comma, and runs of it count once; an empty
    entry between commas (`a,,b`, a leading or trailing comma) is refused.
    """
    expressions, current, depth, expecting_entry = [], "", 0, True
    for character in text:
        if character == "[":
            if depth:
                raise _error(variable, text, "hostlist (nested '[')", _HOSTLIST_EXPECTED)
            depth = 1
        elif character == "]":
            if not depth:
                raise _error(variable, text, "hostlist (']' without '[')", _HOSTLIST_EXPECTED)
            depth = 0
        elif character in _SEPARATORS and not depth:
            if current:
                expressions.append(current)
                current, expecting_entry = "", False
            if character == ",":
                if expecting_entry:
                    raise _error(variable, text, "hostlist (an empty entry)", _HOSTLIST_EXPECTED)
                expecting_entry = True
            continue
        current += character
    if depth:
        raise _error(variable, text, "hostlist (unclosed '[')", _HOSTLIST_EXPECTED)
    if current:
        expressions.append(current)
    elif expecting_entry:
        raise _error(variable, text, "hostlist (an empty entry)", _HOSTLIST_EXPECTED)
    return expressions


def _bracket_numbers(body, text, variable):
    """The numbers of one bracket's body, e.g. `01-03,7` -> ['01', '02', '03', '7']."""
    numbers = []
    for part in body.split(","):
        match = _RANGE_PATTERN.fullmatch(part)
        if match is None:
            raise _error(
                variable, text, f"hostlist range {part!r} in [{body}]", _HOSTLIST_EXPECTED
            )
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if low > high:
            raise _error(
                variable, text, f"hostlist range {part!r} (decreasing)", _HOSTLIST_EXPECTED
            )
        if len(numbers) + high - low + 1 > MAX_HOSTS:
            raise _error(variable, text, "hostlist (too many hosts)", f"at most {MAX_HOSTS} hosts")
        # Slurm pads every number of a range to the width of its lower bound.
        numbers.extend(str(number).zfill(len(low_text)) for number in range(low, high + 1))
    return numbers


def _expand_expression(expression, text, variable):
    # Pieces alternate: literal text, bracket body, literal text, ...
    pieces = re.split(r"\[([^\]]*)\]", expression)
    hosts = [pieces[0]]
    for index in range(1, len(pieces), 2):
        numbers = _bracket_numbers(pieces[index], text, variable)
        if len(hosts) * len(numbers) > MAX_HOSTS:
            raise _error(variable, text, "hostlist (too many hosts)", f"at most {MAX_HOSTS} hosts")
        hosts = [host + number + pieces[index + 1] for host in hosts for number in numbers]
    return hosts


def expand_hostlist(text, variable="hostlist"):
    """Returns the hosts a Slurm hostlist expression names, in order.

    Args:
        text: the expression, e.g. `"node[01-04,07]"`.
        variable: how errors name it, e.g. `"SLURM_STEP_NODELIST"`.

    Returns:
        A list of host names; duplicates are kept, as Slurm keeps them.

    Raises:
        kdist.errors.ClusterEnvironmentError: `text` is empty or malformed
            (unbalanced or nested brackets, an empty entry or bracket, a range
            that is not `low-high` with `low <= high`, more than `MAX_HOSTS`
            hosts). Its `variable` is `variable`.

    Example:

    >>> expand_hostlist("node[01-03,07],login1")
    ['node01', 'node02', 'node03', 'node07', 'login1']
    """
    if not isinstance(text, str) or not text.strip():
        raise _error(variable, text, "hostlist (empty)", _HOSTLIST_EXPECTED)
    hosts = []
    for expression in _split_expressions(text.strip(), variable):
        hosts.extend(_expand_expression(expression, text, variable))
        if len(hosts) > MAX_HOSTS:
            raise _error(variable, text, "hostlist (too many hosts)", f"at most {MAX_HOSTS} hosts")
    if not all(hosts):
        raise _error(variable, text, "hostlist (an empty host name)", _HOSTLIST_EXPECTED)
    return hosts


def expand_tasks_per_node(text, variable="SLURM_STEP_TASKS_PER_NODE"):
    """Returns the task count of each node from Slurm's compact list.

    Args:
        text: the list, e.g. `"2(x3),1"`: counts separated by commas, each
            optionally followed by `(xN)`, "on N consecutive nodes".
        variable: how errors name it.

    Returns:
        A list of positive ints, one per node, in node-list order.

    Raises:
        kdist.errors.ClusterEnvironmentError: `text` is empty or malformed, or
            a count or repetition is 0.

    Example:

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    expected = "Slurm's tasks-per-node list, e.g. '4' or '2(x3),1', with counts of at least 1"
    if not isinstance(text, str) or not text.strip():
        raise _error(variable, text, "tasks-per-node list (empty)", expected)
    counts = []
    for part in text.strip().split(","):
        match = _TASKS_PATTERN.fullmatch(part.strip())
        if match is None:
            raise _error(variable, text, f"tasks-per-node list (entry {part!r})", expected)
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count < 1 or repeat < 1:
            raise _error(variable, text, f"tasks-per-node list (entry {part!r})", expected)
        if len(counts) + repeat > MAX_HOSTS:
            raise _error(variable, text, "tasks-per-node list (too many nodes)", f"at most {MAX_HOSTS}")
        counts.extend([count] * repeat)
    return counts
