"""What `kdist launch` prints when a job failed: the first failure first, the others in a line each.

When one process of a job fails, the others usually fail because of it: every
rank that waited for it in a collective raises `CollectiveTimeoutError`, with a
long traceback (C++ frames included). The first failure is the one to read. So:

- The `ProcessSet` echoes, after the first failure, only that process's output
  (and the stacks it asks the survivors to dump); the others' output goes to
  their logs only (`kdist.launch.child.mute_all_but`).
- At the end the launcher prints a summary (`failure_summary`): which process
  failed first and its traceback again (consequent errors may have come before
  its exit was seen: a rank that closes its connections while Python shuts down
  makes the others fail before it has ended), then one line per other failed
  process, in the order they ended, each with its exception and log file.

The order is the order in which the processes ended, as the launcher saw them
exit; nothing is classified. What is shown of a process's error is the last
Python traceback it wrote to stderr, as it wrote it (display only).
"""

from kdist.launch.child import log_path
from kdist.launch.spec import describe_returncode

TRACEBACK_HEADER = "Traceback (most recent call last):"
# The sentences Python prints between the tracebacks of chained exceptions.
CHAIN_SENTENCES = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
# A summary line stays one line: an exception message longer than this is cut.
MAX_EXCEPTION_CHARS = 240
# The first failure's traceback is printed again at the end, up to this many
# lines (its last ones); the whole of it is in the process's log.
MAX_TRACEBACK_LINES = 60
# Lines of a multi-line exception message (torch appends C++ frames) shown after its first.
MAX_MESSAGE_LINES = 3


def last_traceback(stderr_text):
    """Returns the lines of the last Python traceback in `stderr_text`, chained ones included.

    From the first traceback of the last chain (`"The above exception was the
    direct cause..."`) to the final exception line and at most
    `MAX_MESSAGE_LINES` more lines of its message. A prefix written before
    every line of it (torch's `"[rank1]: "`) is removed. `[]` when there is none.

    Example:
        ```python
        last_traceback(processes.output("worker-1", "stderr"))
        # ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>',
        #  "    import foo", "ModuleNotFoundError: No module named 'foo'"]
        ```
    """
    lines = stderr_text.splitlines()
    headers = [index for index, line in enumerate(lines) if line.endswith(TRACEBACK_HEADER)]
    if not headers:
        return []
    prefix = lines[headers[-1]][: -len(TRACEBACK_HEADER)]
    lines = [line[len(prefix) :] if prefix and line.startswith(prefix) else line for line in lines]
    start = headers[-1]
    for header in reversed(headers[:-1]):
        between = [line for line in lines[header:start] if line.strip()]
        if not any(line in CHAIN_SENTENCES for line in between[-1:]):
            break
        start = header
    end = _exception_index(lines, headers[-1])
    if end is None:
        return lines[start:]
    message = []
    for line in lines[end + 1 : end + 1 + MAX_MESSAGE_LINES]:
        if not line.strip():
            break
        message.append(line)
    return lines[start : end + 1] + message


def final_exception_line(stderr_text):
    """Returns the exception line of the last Python traceback in `stderr_text`, or None.

    That is the first line after the traceback's frames, e.g.
    `"ModuleNotFoundError: No module named 'foo'"`, cut with `"..."` past
    `MAX_EXCEPTION_CHARS`.
    """
    lines = last_traceback(stderr_text)
    headers = [index for index, line in enumerate(lines) if line.endswith(TRACEBACK_HEADER)]
    end = _exception_index(lines, headers[-1]) if headers else None
    if end is None:
        return None
    line = lines[end]
    return line if len(line) <= MAX_EXCEPTION_CHARS else line[: MAX_EXCEPTION_CHARS - 3] + "..."


def _exception_index(lines, header):
    """The index of the exception line of the traceback starting at `header`: its first unindented line.

    Python 3.11's error-location lines (only `^` and `~` under a frame's code) belong to
    the frame however they are indented: a rank prefix removed unevenly, or a stream
    split between two reads, can leave one at the start of a line.
    """
    for index in range(header + 1, len(lines)):
        line = lines[index]
        if line.strip() and not line[0].isspace() and not _is_location_marker(line):
            return index
    return None


def _is_location_marker(line):
    return set(line.strip()) <= set("^~")


def failure_summary(processes, log_dir):
    """Returns the lines that describe a failed job (without the launcher's `[kdist] ` prefix).

    Args:
        processes: the job's finished `ProcessSet`.
        log_dir: the directory of the per-process log files, or None when there are none.

    Returns:
        `[]` when no process failed. Otherwise: the first failure (`"<name>
        failed first: it exited with code 1; exit code 1"`), its last traceback
        (each line after `"| "`), where its full output is, then one line per
        other failed process, in the order they ended, with its exception and log.
    """
    failures = processes.failures()
    if not failures:
        return []
    first_name, first_code = failures[0]
    lines = [
        f"{first_name} failed first: it {describe_returncode(first_code)}; "
        f"exit code {processes.exit_code()}"
    ]
    traceback = last_traceback(processes.output(first_name, "stderr"))
    if len(traceback) > MAX_TRACEBACK_LINES:
        lines.append(f"| ... ({len(traceback) - MAX_TRACEBACK_LINES} lines more in its log)")
        traceback = traceback[-MAX_TRACEBACK_LINES:]
    lines.extend(f"| {line}" for line in traceback)
    lines.append(f"{first_name}'s full output: {_where(log_dir, first_name)}")
    for name, returncode in failures[1:]:
        exception = final_exception_line(processes.output(name, "stderr")) or "no Python traceback"
        lines.append(
            f"then {name} {describe_returncode(returncode)}: {exception} "
            f"(full output: {_where(log_dir, name)})"
        )
    return lines


def _where(log_dir, name):
    return "not kept (no log directory)" if log_dir is None else log_path(log_dir, name)
