"""Children's output: kept line by line in memory and echoed live with a name prefix.

A `ProcessSet` gives every child two pipes (stdout, stderr). One `pump` thread per
pipe reads whatever the child wrote as soon as it arrives, writes it to the
parent's matching stream through a `PrefixedSink` and appends each complete line
to the child's `OutputLog` (and log file).

The sink starts every line, and every carriage-return segment, with the child's
prefix: a child writing `"a\rb\rc\n"` shows as `"[chief-0] a\r[chief-0] b\r[chief-0] c\n"`,
so progress bars (Keras' `Progbar`, tqdm) stay live and keep their prefix. Text
is forwarded without waiting for a newline; when another child writes while a
line is unfinished, the sink ends that line first and the unfinished one goes on
under a fresh prefix, so lines of different children never share a row.
"""

import codecs
import collections
import re
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

    def reopen(self):
        """Records that the child was started again: two more pipes to read."""
        with self._condition:
            self._open_streams += len(STREAMS)
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


# What one `pump` read asks for: more than a pipe holds (64 KiB on Linux), so a
# read takes everything written so far.
READ_BYTES = 1 << 17

# Where a writer's current line stands on the sink's target.
_FRESH = "fresh"  # Nothing of it written yet (start, or after "\n").
_RETURNED = "returned"  # Content written, then "\r": the next content overwrites it.
_INLINE = "inline"  # Content written since the prefix.
# Content written, then the sink ended the line for another writer: the writer's
# own "\n" that follows ends nothing more (no empty line under its prefix).
_INTERRUPTED = "interrupted"

# A token is a newline, a carriage return, a backspace (Keras' Progbar writes
# backspaces before its "\r") or a run of anything else.
_TOKENS = re.compile(r"\n|\r|\x08|[^\n\r\x08]+")


class PrefixedSink:
    """Writes children's text with a prefix per line to the parent's stdout or stderr.

    Thread-safe: one lock per sink. Each `write` goes out in one piece; text may
    arrive in any fragments (partial lines, carriage-return segments). The prefix
    is written before the first visible character of every line and after every
    `"\r"`. When a writer's line is unfinished and another writer's text comes,
    the sink writes `"\n"` first and the interrupted writer's next text starts
    under a new prefix. With `stream=None` the target is looked up at every write
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
        self._states = {}  # prefix -> _FRESH / _RETURNED / _INLINE
        self._open = None  # The prefix whose line is unfinished on the target.

    def write(self, prefix, text, echoing=None):
        """Writes `text` with `prefix` on each line; a closed or broken target is ignored.

        `echoing`, if given, is asked under the sink's lock: when it returns
        False nothing is written. So a writer muted before a message went
        through this sink writes nothing after that message.
        """
        if not self._enabled or not text:
            return
        with self._lock:
            if echoing is not None and not echoing():
                return
            pieces = []
            if self._open not in (None, prefix):
                pieces.append("\n")
                self._states[self._open] = _INTERRUPTED
            state = self._states.get(prefix, _FRESH)
            for match in _TOKENS.finditer(text):
                token = match.group()
                if token == "\n":
                    if state == _INTERRUPTED:
                        state = _FRESH
                        continue  # The sink already ended this line.
                    if state == _FRESH:
                        pieces.append(prefix)  # An empty line still names its writer.
                    state = _FRESH
                elif token == "\r":
                    state = state if state in (_FRESH, _INTERRUPTED) else _RETURNED
                elif token != "\x08" and state != _INLINE:
                    pieces.append(prefix)
                    state = _INLINE
                pieces.append(token)
            self._states[prefix] = state
            self._open = None if state in (_FRESH, _INTERRUPTED) else prefix
            self._emit("".join(pieces))

    def end(self, prefix):
        """Ends the writer's unfinished line, if any (its pipe reached end of file)."""
        if not self._enabled:
            return
        with self._lock:
            self._states.pop(prefix, None)
            if self._open == prefix:
                self._open = None
                self._emit("\n")

    def _emit(self, text):
        target = self._stream if self._stream is not None else getattr(sys, self._stream_name)
        try:
            target.write(text)
            target.flush()
        except (OSError, ValueError, AttributeError):
            # The parent's stream went away (pytest tore down its capture,
            # a closed pipe); the text is still in the child's OutputLog.
            pass


class _LineSplitter:
    """Cuts text arriving in fragments into whole lines (each ending with "\n")."""

    def __init__(self):
        self._pending = []

    def feed(self, text):
        """Returns the lines that `text` completes."""
        if "\n" not in text:
            if text:
                self._pending.append(text)
            return []
        *lines, rest = text.split("\n")
        lines[0] = "".join(self._pending) + lines[0]
        self._pending = [rest] if rest else []
        return [line + "\n" for line in lines]

    def rest(self):
        """The unfinished last line with a "\n" added, or "" if there is none."""
        rest, self._pending = "".join(self._pending), []
        return rest + "\n" if rest else ""


def pump(pipe, stream, log, sink, prefix, log_file=None, log_file_lock=None, echoing=None):
    """Copies `pipe` into `sink` as it arrives and, line by line, into `log` and `log_file`.

    Runs in its own thread until end of file; closes `pipe`. A child that never
    ends keeps this thread blocked, which is why pump threads are daemons and the
    owner joins them with a deadline. A last line without a newline gets one.
    `echoing`, if given, is passed to `sink.write`: while it returns False the
    text goes only to `log` and `log_file` (the owner muted the child).
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    splitter = _LineSplitter()

    def record(lines):
        for line in lines:
            log.append(stream, line)
            if log_file is not None:
                with log_file_lock:
                    log_file.write(line)
                    log_file.flush()

    def forward(text):
        sink.write(prefix, text, echoing)
        record(splitter.feed(text))

    # read1 returns what the pipe holds as soon as it holds anything; a raw
    # (unbuffered) pipe's read does the same.
    read = pipe.read1 if hasattr(pipe, "read1") else pipe.read
    try:
        with pipe:
            for chunk in iter(lambda: read(READ_BYTES), b""):
                forward(decoder.decode(chunk))
            forward(decoder.decode(b"", final=True))
    except (OSError, ValueError):
        pass  # The pipe was closed under us while the owner shut down.
    finally:
        record([line for line in (splitter.rest(),) if line])
        sink.end(prefix)
        log.close_stream()
