"""Tests for kdist.launch.output: the per-process line log and the live, prefixed echo."""

import io
import signal
import sys
import threading
from pathlib import Path

from kdist.launch import ProcessSet, ProcessSpec
from kdist.launch.output import STDERR, STDOUT, OutputLog, PrefixedSink, pump


def test_text_keeps_arrival_order_and_filters_by_stream():
    log = OutputLog()
    log.append(STDOUT, "a\n")
    log.append(STDERR, "b\n")
    log.append(STDOUT, "c\n")

    assert log.text() == "a\nb\nc\n"
    assert log.text(STDOUT) == "a\nc\n"
    assert log.text(STDERR) == "b\n"


def test_keep_lines_bounds_memory():
    log = OutputLog(keep_lines=2)
    for line in ("1\n", "2\n", "3\n"):
        log.append(STDOUT, line)

    assert log.text() == "2\n3\n"
    assert log.wait_for("1\n", timeout=0) is False


def test_wait_for_finds_text_spanning_lines_that_arrive_later():
    log = OutputLog()
    log.append(STDOUT, "loss: 0.5\n")

    def write_more():
        for line in ("x\n", "epoch 2\n", "done\n", "y\n", "z\n"):
            log.append(STDOUT, line)

    writer = threading.Timer(0.05, write_more)
    writer.start()
    try:
        assert log.wait_for("epoch 2\ndone", timeout=10)
    finally:
        writer.join()
    assert log.wait_for("loss", timeout=0)


def test_wait_for_gives_up_when_both_streams_closed_or_at_the_deadline():
    log = OutputLog()
    assert log.wait_for("never", timeout=0.05) is False
    log.close_stream()
    log.close_stream()
    assert log.closed
    assert log.wait_for("never", timeout=60) is False


def test_sink_prefixes_and_survives_a_closed_stream():
    stream = io.StringIO()
    sink = PrefixedSink(STDOUT, stream)
    sink.write("[worker-0] ", "hello\n")
    assert stream.getvalue() == "[worker-0] hello\n"
    stream.close()
    sink.write("[worker-0] ", "after close\n")  # Ignored, no exception.
    PrefixedSink(STDOUT, io.StringIO(), enabled=False).write("[x] ", "dropped\n")


# -- Live, prefixed forwarding ----------------------------------------------------

SCRIPTS = Path(__file__).parent / "scripts"
# Every wait below is bounded by this; reaching it is a failure.
TIMEOUT = 30.0


class WatchedStream:
    """A text stream a test can wait on: `wait_for` returns once the text holds a substring."""

    def __init__(self):
        self._text = ""
        self._condition = threading.Condition()

    def write(self, text):
        with self._condition:
            self._text += text
            self._condition.notify_all()

    def flush(self):
        pass

    def getvalue(self):
        with self._condition:
            return self._text

    def wait_for(self, substring, timeout=TIMEOUT):
        with self._condition:
            return self._condition.wait_for(lambda: substring in self._text, timeout)


def writes(name, *segments):
    """A child writing `segments` one by one, waiting for SIGUSR1 between two."""
    escaped = [segment.encode("unicode_escape").decode("ascii") for segment in segments]
    return ProcessSpec(name, [sys.executable, str(SCRIPTS / "progress.py"), *escaped])


def test_sink_prefixes_every_carriage_return_segment():
    stream = io.StringIO()
    sink = PrefixedSink(STDOUT, stream)
    for fragment in ("a", "\rb", "\r", "c\n", "\n", "d\r\n"):
        sink.write("[chief-0] ", fragment)
    assert stream.getvalue() == "[chief-0] a\r[chief-0] b\r[chief-0] c\n[chief-0] \n[chief-0] d\r\n"


def test_sink_leaves_progbar_backspaces_unprefixed():
    # Keras' Progbar writes backspaces over its previous bar, then "\r", then the new bar.
    stream = io.StringIO()
    sink = PrefixedSink(STDOUT, stream)
    sink.write("[w] ", "1/2 ━")
    sink.write("[w] ", "\b\b\b\b\b\r2/2 ━━\n")
    assert stream.getvalue() == "[w] 1/2 ━\b\b\b\b\b\r[w] 2/2 ━━\n"


def test_sink_ends_an_unfinished_line_before_another_writer_and_at_the_end():
    stream = io.StringIO()
    sink = PrefixedSink(STDOUT, stream)
    sink.write("[a] ", "\r 10%")
    sink.write("[b] ", "whole line\n")
    sink.write("[a] ", "\r 20%")
    sink.write("[a] ", " more")
    sink.write("[b] ", "half")
    sink.write("[a] ", "tail")
    sink.end("[a] ")  # a's line was already ended for b: nothing to add.
    sink.end("[b] ")  # b's was not.
    assert stream.getvalue() == (
        "\r[a]  10%\n[b] whole line\n\r[a]  20% more\n[b] half\n[a] tail\n"
    )


def test_carriage_return_segments_are_forwarded_live_with_their_prefix():
    stream = WatchedStream()
    specs = [writes("task-0", "a", "\rb", "\rc\n")]
    with ProcessSet(specs, stdout=stream, stderr=io.StringIO()) as processes:
        processes.start()
        # Each segment shows before the next one (and the newline) is even written.
        assert stream.wait_for("[task-0] a"), stream.getvalue()
        assert processes.output("task-0", STDOUT) == ""  # The log keeps whole lines only.
        processes.send_signal("task-0", signal.SIGUSR1)
        assert stream.wait_for("[task-0] a\r[task-0] b"), stream.getvalue()
        processes.send_signal("task-0", signal.SIGUSR1)
        processes.wait(TIMEOUT)

    assert processes.returncodes == {"task-0": 0}
    assert stream.getvalue() == "[task-0] a\r[task-0] b\r[task-0] c\n"
    assert processes.output("task-0", STDOUT) == "a\rb\rc\n"


def test_a_line_from_another_task_does_not_land_inside_a_progress_bar():
    stream = WatchedStream()
    specs = [writes("chief-0", "\r 10%", "\r100%\n"), writes("worker-0", "", "line\n")]
    with ProcessSet(specs, stdout=stream, stderr=io.StringIO()) as processes:
        processes.start()
        assert stream.wait_for("[chief-0]  10%"), stream.getvalue()
        assert processes.wait_for_output("worker-0", "ready", TIMEOUT)
        processes.send_signal("worker-0", signal.SIGUSR1)
        assert stream.wait_for("[worker-0] line\n"), stream.getvalue()
        processes.send_signal("chief-0", signal.SIGUSR1)
        processes.wait(TIMEOUT)

    assert processes.returncodes == {"chief-0": 0, "worker-0": 0}
    assert stream.getvalue() == "\r[chief-0]  10%\n[worker-0] line\n\r[chief-0] 100%\n"
    assert processes.output("chief-0", STDOUT) == "\r 10%\r100%\n"


class ChunkedPipe:
    """A pipe whose reads return the given byte chunks, then end of file."""

    def __init__(self, chunks):
        self._chunks = list(chunks)

    def read1(self, size):
        return self._chunks.pop(0) if self._chunks else b""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


def test_pump_keeps_characters_split_between_reads_and_logs_whole_lines():
    encoded = "━ 1/2\r━━ 2/2\nlast".encode()
    split = encoded.index("━".encode()) + 1  # Inside the first character's three bytes.
    chunks = [encoded[:split], encoded[split : split + 7], encoded[split + 7 :]]
    stream, log_file = io.StringIO(), io.StringIO()
    log = OutputLog()
    sink = PrefixedSink(STDOUT, stream)
    pump(ChunkedPipe(chunks), STDOUT, log, sink, "[w] ", log_file, threading.Lock())

    assert stream.getvalue() == "[w] ━ 1/2\r[w] ━━ 2/2\n[w] last\n"
    assert log.text() == log_file.getvalue() == "━ 1/2\r━━ 2/2\nlast\n"
    assert not log.closed  # One of the child's two streams ended.


def test_an_unfinished_last_line_is_ended():
    stream = WatchedStream()
    specs = [writes("task-0", "━━ no newline")]
    with ProcessSet(specs, stdout=stream, stderr=io.StringIO()) as processes:
        processes.start()
        processes.wait(TIMEOUT)
    assert stream.getvalue() == "[task-0] ━━ no newline\n"
    assert processes.output("task-0", STDOUT) == "━━ no newline\n"
