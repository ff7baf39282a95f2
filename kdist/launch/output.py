"""Children's output: kept line by line in memory and echoed with a name prefix.

A `ProcessSet` gives every child two pipes (stdout, stderr). One `pump` thread per
pipe reads it line by line, appends each line to the child's `OutputLog` and writes
`"[worker-0] " + line` to the parent's matching stream through a `PrefixedSink`,
which keeps lines from different children whole.
"""

import collections
import sys
import threading
import time

STDOUT = "stdout"
STDERR = "stderr"
STREAMS = (STDOUT, STDERR)


class OutputLog:
    """Every line one child wrote, in arrival order.

    Thread-safe: pump threads append while any thread reads or waits.

    Args:
        keep_lines: keep only the last `keep_lines` lines (None keeps all). A
            launcher running for days bounds its memory with it; tests keep all.
    """

    def __init__(self, keep_lines=None):
        self._lines = collections.deque(maxlen=keep_lines)
        self._num_appended = 0  # Ever appended, including lines the deque dropped.
        self._open_streams = len(STREAMS)
        self._condition = threading.Condition()

    def append(self, stream, line):
        """Records one line (with its newline) read from `stream`."""
        with self._condition:
            self._lines.append((stream, line))
            self._num_appended += 1
            self._condition.notify_all()

    def close_stream(self):
        """Records that one of the child's pipes reached end of file."""
        with self._condition:
            self._open_streams -= 1
            self._condition.notify_all()

    @property
    def closed(self):
        """True once both pipes reached end of file: no line can arrive any more."""
        with self._condition:
            return self._open_streams <= 0

    def text(self, stream=None):
        """Returns the kept lines of `stream` ("stdout", "stderr"), or of both if None."""
        with self._condition:
            return "".join(line for source, line in self._lines if stream in (None, source))

    def wait_for(self, substring, timeout):
        """Waits until the output contains `substring`.

        Returns:
            True as soon as it does; False at the deadline or when both pipes
            closed without it (the child ended), whichever comes first. With
            `keep_lines`, lines dropped before this call looked at them are missed.
        """
        deadline = time.monotonic() + timeout
        # Each wake-up searches only the new lines plus the tail of the old text
        # that a match could start in, so a long wait on a chatty child stays linear.
        overlap = max(len(substring) - 1, 0)
        with self._condition:
            text = "".join(line for _, line in self._lines)
            num_seen = self._num_appended
            while True:
                if substring in text:
                    return True
                text = text[len(text) - overlap :] if overlap else ""
                remaining = deadline - time.monotonic()
                if self._open_streams <= 0 or remaining <= 0:
                    return False
                self._condition.wait(remaining)
                num_new = min(self._num_appended - num_seen, len(self._lines))
                num_seen = self._num_appended
                text += "".join(
                    self._lines[i][1] for i in range(len(self._lines) - num_new, len(self._lines))
                )


class PrefixedSink:
    """Writes whole lines with a prefix to the parent's stdout or stderr.

    Thread-safe: one lock per sink keeps lines of different children from
    interleaving. With `stream=None` the target is looked up at every write
    (`sys.stdout` / `sys.stderr`), so output captured by pytest lands in the
    capture that is active at that moment.

    Args:
        stream_name: "stdout" or "stderr", the parent stream used when `stream` is None.
        stream: a text file object to write to instead, or None.
        enabled: False drops every line (the in-memory log still keeps them).
    """

    def __init__(self, stream_name, stream=None, enabled=True):
        self._stream_name = stream_name
        self._stream = stream
        self._enabled = enabled
        self._lock = threading.Lock()

    def write(self, prefix, line):
        """Writes `prefix + line`; a closed or broken target is ignored."""
        if not self._enabled:
            return
        with self._lock:
            target = self._stream if self._stream is not None else getattr(sys, self._stream_name)
            try:
                target.write(prefix + line)
                target.flush()
            except (OSError, ValueError, AttributeError):
                # The parent's stream went away (pytest tore down its capture,
                # a closed pipe); the line is still in the child's OutputLog.
                pass


def pump(pipe, stream, log, sink, prefix, log_file=None, log_file_lock=None):
    """Copies `pipe` line by line into `log`, `sink` and optionally `log_file`.

    Runs in its own thread until end of file; closes `pipe`. A child that never
    ends keeps this thread blocked, which is why pump threads are daemons and the
    owner joins them with a deadline.
    """
    try:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"
                log.append(stream, line)
                sink.write(prefix, line)
                if log_file is not None:
                    with log_file_lock:
                        log_file.write(line)
                        log_file.flush()
    except (OSError, ValueError):
        pass  # The pipe was closed under us while the owner shut down.
    finally:
        log.close_stream()
