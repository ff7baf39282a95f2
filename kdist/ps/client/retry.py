"""`VariableClient`'s calls: one deadline for all attempts, retries on UNAVAILABLE (a server coming back) and refused slots, a watchdog."""

import itertools
import os
import random
import time
import uuid
from collections.abc import Iterator

import grpc

from kdist.errors import ParameterServerError, ParameterServerUnavailableError
from kdist.ps.wire.methods import METHODS
from kdist.ps.wire.status import SLOT_REFUSED_KEY, client_error
from kdist.rpc.watchdog import CallCancelled, GRACE_SECONDS, watched_call

# gRPC's own retry policy is off: with it on, a pull stream in flight when its
# server was `kill -9`ed could block far past its deadline. The client retries
# instead (`call`): a call that failed with UNAVAILABLE (server
# restarting, connection refused or reset) is sent again up to this many times
# in all, backing off 0.1 s, 0.2 s, ... up to 1 s: about 1.5 s in total, then the
# client raises ParameterServerUnavailableError. Only calls that are safe to
# repeat are retried: every one but a push or assign without an `update_id`.
MAX_ATTEMPTS = 5
RETRY_BACKOFF_SECONDS = (0.1, 1.0)  # (initial, max); doubles at each retry
# A server that had no stream slot free refuses a call before reading any of
# it (`RESOURCE_EXHAUSTED` with the trailing metadata `SLOT_REFUSED_KEY`,
# `kdist.ps.server.stream_guard`): the job's own concurrency (many workers, or many
# threads of one) outgrew the server's slots for a moment. Such a call is sent
# again, any call (a push without an update id too: nothing of it was applied),
# as often as its deadline allows, after a jittered backoff drawn from
# [b/2, b], with b doubling from the first value to the second: refused
# callers spread out instead of coming back together. Other `RESOURCE_EXHAUSTED`
# answers (a message over the size limit, the server's memory or disk full)
# are never retried.
SLOT_BACKOFF_SECONDS = (0.01, 0.5)
# A server that answered before and is now gone (`UNAVAILABLE` once the client
# was connected: killed, restarting under `kdist launch --ps`) is coming back:
# any call but a `Health` probe is sent again after a jittered backoff from
# [b/2, b], b doubling up to the second value, until the server answers or
# `ServiceOptions.recovery_timeout_seconds` passed since the call found it
# gone (within the call's deadline); then `ParameterServerUnavailableError`
# says it did not come back. A push is sent again with its update id, so one
# that reached the server before it died is applied once in all.
RECOVERY_BACKOFF_SECONDS = (0.1, 1.0)
_PROBES = ("Health",)
# Update ids of pushes the caller gave none: unique to this process (its pid is
# added per call, so that a forked child never repeats its parent's ids).
_FRESH_PREFIX = f"kdist-{uuid.uuid4().hex[:12]}"
_fresh_ids = itertools.count()


def update_id_or_fresh(update_id):
    """`update_id`, or a fresh id unique to this process when it is None or "".

    Every push then carries an id, so that one whose server went away before
    answering can be sent again without being applied twice.
    """
    return update_id or f"{_FRESH_PREFIX}-{os.getpid()}/{next(_fresh_ids)}"


def call(client, name, request, read=None, timeout=None, wait_for_ready=None, retry=True):
    """Runs one call, retried on UNAVAILABLE while `retry` and time allow, and on a refused slot.

    `request` is a message, or a function returning a fresh request stream
    (a stream is consumed by the attempt that sends it). The whole call,
    retries included, ends within its deadline plus `GRACE_SECONDS`.
    """
    deadline = client.options.rpc_timeout_seconds if timeout is None else timeout
    if wait_for_ready is None and not client._connected:
        wait_for_ready = True
        deadline += client.options.connect_timeout_seconds
    started = time.monotonic()
    # When this client found its (earlier reachable) server gone: kept across
    # calls, so that once the window has passed later calls fail at once.
    gone_since = client._gone_since
    recovery = client.options.recovery_timeout_seconds if name not in _PROBES else 0
    backoff = RETRY_BACKOFF_SECONDS[0]
    slot_backoff = SLOT_BACKOFF_SECONDS[0]
    attempt, slot_refusals = 1, 0
    while True:
        remaining = started + deadline - time.monotonic()
        try:
            result = _attempt(client, name, request, read, remaining, wait_for_ready)
            break
        except grpc.RpcError as error:
            elapsed = time.monotonic() - started
            if _slot_refused(error):
                slot_refusals += 1
                delay = random.uniform(slot_backoff / 2, slot_backoff)
                if elapsed + delay < deadline and not client._closed.wait(delay):
                    slot_backoff = min(2 * slot_backoff, SLOT_BACKOFF_SECONDS[1])
                    continue
                raise _slot_error(client, error, slot_refusals, elapsed, deadline) from None
            if (retry and recovery and client._connected
                    and _code(error) == grpc.StatusCode.UNAVAILABLE):
                gone_since = time.monotonic() if gone_since is None else gone_since
                # Another call (or `give_up`) may have found it gone earlier.
                gone_since = min(gone_since, client._gone_since or gone_since)
                client._gone_since = gone_since
                limit = min(deadline, gone_since - started + recovery)
                # The last attempt lands on the limit: the window is waited in full.
                delay = min(random.uniform(backoff / 2, backoff), limit - elapsed)
                if delay > 0 and not client._closed.wait(delay):
                    attempt += 1
                    backoff = min(2 * backoff, RECOVERY_BACKOFF_SECONDS[1])
                    continue
                raise _gone_error(client, error, deadline, started, gone_since) from None
            if (retry and attempt < MAX_ATTEMPTS and _code(error) == grpc.StatusCode.UNAVAILABLE
                    and elapsed + backoff < deadline and not client._closed.wait(backoff)):
                attempt += 1
                backoff = min(2 * backoff, RETRY_BACKOFF_SECONDS[1])
                continue
            raise client_error(error, client.address, deadline, elapsed) from None
        except CallCancelled:
            raise ParameterServerUnavailableError(
                client.address, deadline,
                f"{name} had no answer {GRACE_SECONDS:g} s past its deadline and was cancelled",
                time.monotonic() - started) from None
    client._connected = True
    client._gone_since = None
    return result


def give_up(client):
    """Ends the wait for `client`'s server: its owner declared it gone for good.

    Calls waiting for it to come back, and later calls that find it
    unavailable, raise `ParameterServerUnavailableError` at once instead of
    waiting out `recovery_timeout_seconds`. An answer from the server ends this.
    """
    gone = time.monotonic() - client.options.recovery_timeout_seconds
    client._gone_since = min(gone, client._gone_since or gone)


def _attempt(client, name, request, read, remaining, wait_for_ready):
    multi_callable = client._calls[name]
    response_streaming = METHODS[name].response_streaming
    if callable(request):
        request = _single_or_stream(request())
        if not isinstance(request, Iterator):
            # One message: sent as a unary request, answered as a stream (see
            # `VariableClient._single_calls`), of one message for a unary method.
            multi_callable = client._single_calls[name]
            if not response_streaming:
                read, response_streaming = _only_message(client, name, read), True
    return watched_call(multi_callable, response_streaming, request, read,
                        timeout=max(remaining, 0.0), metadata=client._metadata,
                        wait_for_ready=wait_for_ready)


def _only_message(client, name, read):
    """Reads a unary method's answer from a response stream: exactly one message."""

    def read_one(responses):
        responses = iter(responses)
        response = next(responses, None)
        if response is None or next(responses, None) is not None:
            raise ParameterServerError(
                client.address, grpc.StatusCode.INTERNAL.name,
                f"the server answered {name} with {'no' if response is None else 'more than one'} "
                "message; a kdist server answers it with exactly one")
        return response if read is None else read(response)

    return read_one


def _single_or_stream(messages):
    """The only message of `messages`, or an iterator over all of them (still lazy after the second)."""
    messages = iter(messages)
    first = next(messages, None)
    second = next(messages, None)
    if second is None:
        return first
    return itertools.chain((first, second), messages)


def _slot_refused(error):
    """True for a refusal for want of a stream slot (never a memory or size refusal)."""
    if _code(error) != grpc.StatusCode.RESOURCE_EXHAUSTED or not hasattr(error, "trailing_metadata"):
        return False
    return any(key == SLOT_REFUSED_KEY for key, _ in error.trailing_metadata() or ())


def _slot_error(client, error, refusals, elapsed, deadline):
    detail = error.details() if hasattr(error, "details") else str(error)
    return ParameterServerError(
        client.address, grpc.StatusCode.RESOURCE_EXHAUSTED.name,
        f"{detail or ''} The call was refused {refusals} times in {elapsed:.1f} s and its "
        f"deadline ({deadline:g} s) left no time to wait longer; if the server is busy with "
        "the job's own calls, raise ServiceOptions.max_workers (server) or rpc_timeout_seconds.")


def _gone_error(client, error, deadline, started, gone_since):
    detail = error.details() if hasattr(error, "details") else str(error)
    now = time.monotonic()
    return ParameterServerUnavailableError(
        client.address, deadline,
        f"the server went away and did not come back within {now - gone_since:.1f} s "
        f"(ServiceOptions.recovery_timeout_seconds="
        f"{client.options.recovery_timeout_seconds:g}, within the call's deadline); was it "
        f"restarted (kdist launch --max-ps-restarts)? Last error: {detail or ''}",
        now - started)


def _code(error):
    return error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
