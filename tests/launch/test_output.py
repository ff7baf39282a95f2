"""Tests for kdist.launch.output: the per-process line log and prefixed echo."""

import io
import threading

from kdist.launch.output import STDERR, STDOUT, OutputLog, PrefixedSink


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
