"""The gRPC servicer: decodes requests, calls the store, encodes responses.

Every method runs inside `_serve`, the one place where domain errors become
status codes (`kdist.ps.wire.status.status_code`), where error details are capped
(`cap_detail`: a detail never echoes a whole request), where requests are
counted, and where streaming calls are admitted to a bounded slot and watched
for an idle client (`kdist.ps.server.stream_guard`). A call its client cancelled
(or the guard cancelled) logs one line, not a traceback.
A request is validated in full — header first, before its payload is stored,
then its content — before anything changes; a failed request changes nothing
and the server keeps serving.
"""

import collections
import contextlib
import itertools
import logging
import os
import time

import grpc
import numpy as np

from kdist.errors import InvalidArgumentError
from kdist.ps.options import ServiceOptions
from kdist.ps.server import checkpoint, server_init
from kdist.ps.server.row_updates import check_row_ids
from kdist.ps.server.store import GradientSpec
from kdist.ps.server.stream_guard import StreamGuard
from kdist.ps.server.variable_entry import locked
from kdist.ps.wire import codec
from kdist.ps.wire._generated import variable_service_pb2 as pb
from kdist.ps.wire.methods import METHODS, SERVICE_NAME
from kdist.ps.wire.status import FailedPreconditionError, cap_detail, name_list, status_code
from kdist.ps.wire.values import check_name, check_outcome, check_update_id

logger = logging.getLogger(__name__)


class VariableServicer:
    """Serves one `VariableStore`. Thread-safe (the store is).

    Args:
        store: the `kdist.ps.server.store.VariableStore`.
        chunk_bytes: payload bytes per response message.
        options: the server's `ServiceOptions`, for the stream bounds and the
            idle timeout (`StreamGuard.from_options`). None: the defaults.
        autosaver: a `kdist.ps.server.autosaver.Autosaver` that checkpoints the store
            around the requests that change it, or None.
    """

    def __init__(self, store, chunk_bytes, options=None, autosaver=None):
        self.store = store
        self.autosaver = autosaver
        self.chunk_bytes = chunk_bytes
        self.started = time.monotonic()
        self.guard = StreamGuard.from_options(ServiceOptions() if options is None else options)
        self._buffers = codec.BufferPool()

    def handlers(self):
        """Returns the `grpc.GenericRpcHandler` of every method."""
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            name: method.handler(self._serve(method, getattr(self, method.key)))
            for name, method in METHODS.items()
        })

    def _serve(self, method, behavior):
        key = method.key
        streaming = method.request_streaming or method.response_streaming

        def serve(request, context):
            self.store.count_request(key)
            call = self._admit(method, context) if streaming else None
            if call is not None and method.request_streaming:
                request = self.guard.requests(call, request)
            handed_over = False  # the response stream releases the call
            try:
                result = behavior(request)
                # Everything that can fail runs inside the try, so errors map to
                # statuses: streamed responses are either built in full (a list,
                # which gRPC wants as an iterator) or, for variable values, only
                # sliced into messages after the try (_variables_response).
                result = iter(result) if isinstance(result, list) else result
                if call is not None and method.response_streaming:
                    result, handed_over = self.guard.responses(call, result), True
                return result
            except Exception as error:  # noqa: BLE001 — mapped to a status, never fatal
                if not context.is_active() or (call is not None and call.idle_cancelled):
                    self._log_ended(method, context, call)
                    context.abort(grpc.StatusCode.CANCELLED, "The call was cancelled.")
                code = status_code(error)
                if code == grpc.StatusCode.INTERNAL:
                    logger.exception("%s failed unexpectedly", key)
                context.abort(code, cap_detail(f"{type(error).__name__}: {error}"))
            finally:
                if call is not None and not handed_over:
                    self.guard.release(call)

        return serve

    def _admit(self, method, context):
        try:
            return self.guard.admit(method.name, context)
        except Exception as error:  # noqa: BLE001 — ResourceExhaustedError, refused
            context.abort(status_code(error), cap_detail(f"{type(error).__name__}: {error}"))

    @staticmethod
    def _log_ended(method, context, call):
        # One line: a client that cancels or times out mid-stream is routine,
        # and a stream the guard cancelled was logged by the guard already.
        if call is None or not call.idle_cancelled:
            logger.info("%s from %s ended: the client cancelled it or its deadline passed.",
                        method.name, context.peer())

    # -- Variables ----------------------------------------------------------------

    def create(self, frames):
        header, arrays = codec.read_stream(frames, self._create_layout, "create")
        self.store.count_bytes(received=sum(array.nbytes for array in arrays))
        initialised = [item for item in header.items if item.HasField("initializer")]
        existing = set(self.store.names()) if initialised else set()
        arrays = iter(arrays)
        values = [self._initial_value(item, existing) if item.HasField("initializer") else next(arrays)
                  for item in header.items]
        # Variables of an old job's checkpoints take their old rows and version (kdist.ps.server.reshard).
        resharder = self.autosaver and self.autosaver.reshard
        values, resharded = resharder.fill(header.items, values) if resharder else (values, {})
        with self._changing():
            results = self.store.create([
                (item.name, array, item.trainable) for item, array in zip(header.items, values)
            ])
            if resharder:
                resharder.created(results, resharded)
        # A table initialised here is never sent back: its creator holds no copy.
        kept = {item.name for item in initialised}
        kept.update(entry.name for entry, was_created in results if was_created and entry.name not in resharded)
        return self._variables_response(
            [entry for entry, _ in results], lambda entry: entry.name not in kept
        )

    @staticmethod
    def _initial_value(item, existing):
        dtype, shape = codec.parse_meta(item.value, f"variable {item.name!r}")
        if item.name in existing:  # the first creator's value stays: only its shape and dtype are compared
            return np.broadcast_to(np.zeros((), dtype), shape)
        spec = item.initializer
        return server_init.initial_shard(spec.config_json, spec.full_shape, spec.row_start, shape, dtype)

    @staticmethod
    def _create_layout(header):
        names = [item.name for item in header.items]
        for name in names:
            check_name(name)
        if len(set(names)) != len(names):
            repeated = sorted(name for name, count in collections.Counter(names).items()
                              if count > 1)
            raise InvalidArgumentError(
                f"A create request names each variable once. Received: {name_list(repeated)} "
                "more than once."
            )
        return [codec.parse_meta(item.value, f"variable {item.name!r}") for item in header.items
                if not item.HasField("initializer")]

    def pull(self, request):
        known = dict(request.known_versions)
        entries = self.store.entries(list(request.names))
        return self._variables_response(
            entries, lambda entry: known.get(entry.name) != entry.version
        )

    def _variables_response(self, entries, send_value):
        # Under the locks: a consistent set of versions and values. The values
        # are shared, not copied (see VariableEntry.share), and copied once,
        # into the messages, while gRPC sends the previous ones.
        with locked(entries):
            sends = [send_value(entry) for entry in entries]
            header = pb.VariablesHeader(variables=[
                pb.VariableMeta(name=entry.name, value=codec.tensor_meta(entry.array),
                                version=entry.version, has_value=send,
                                trainable=entry.trainable)
                for entry, send in zip(entries, sends)
            ])
            shared = [(entry, *entry.share()) for entry, send in zip(entries, sends) if send]
        self.store.count_bytes(sent=sum(array.nbytes for _, _, array in shared))
        stream = self._stream_shared(header, shared)
        # Started here, so that its `finally` (which ends the shares) runs even
        # when gRPC drops the stream before reading it.
        return itertools.chain([next(stream)], stream)

    def _stream_shared(self, header, shared):
        try:
            yield from codec.encode_stream(
                header, [codec.byte_view(array) for _, _, array in shared], self.chunk_bytes)
        finally:
            for entry, token, _ in shared:
                entry.release(token)

    # -- Updates ------------------------------------------------------------------

    def push(self, frames, gradients_allowed=True):
        plans = []

        def layout(header):
            if header.gradients and not gradients_allowed:
                raise InvalidArgumentError(
                    "An assign request carries no gradients. Received: "
                    f"{len(header.gradients)} gradient(s); push them instead."
                )
            check_update_id(header.update_id)
            check_outcome(header.outcome)
            plans.append(self.store.plan_update(
                [_gradient_spec(meta) for meta in header.gradients],
                [(meta.name, *codec.parse_meta(meta.value, f"assignment to {meta.name!r}"))
                 for meta in header.assignments],
            ))
            return plans[0].layout

        def allocate(index, dtype, shape):
            # Gradient buffers come first in the layout; assignments are kept
            # as the variables' new values, so they are never pooled.
            if index < len(plans[0].layout) - len(plans[0].assignments):
                return self._buffers.take(dtype, shape)
            return None

        header, arrays = codec.read_stream(frames, layout, "push", allocate)
        self.store.count_bytes(received=sum(array.nbytes for array in arrays))
        try:
            with self._applying():
                applied = self.store.apply_update(
                    plans[0], arrays, count_push=gradients_allowed, update_id=header.update_id,
                    outcome=header.outcome)
                counted = self.autosaver is not None and self.autosaver.count_applied()
            # Saved before the answer: an acknowledged push is in a due checkpoint.
            if counted and gradients_allowed:
                self.autosaver.after_push()
            elif counted:
                self.autosaver.after_change()
        finally:
            for array in arrays[: len(arrays) - len(plans[0].assignments)]:
                self._buffers.give(array)
        return pb.PushResponse(versions=applied.versions, rejected=applied.rejected,
                               staleness=applied.staleness, deduplicated=applied.deduplicated,
                               outcome=applied.outcome)

    def assign(self, frames):
        return self.push(frames, gradients_allowed=False)

    def lookup(self, frames):
        entries = []

        def layout(header):
            entries.extend(self.store.entries([item.name for item in header.items]))
            shapes = []
            for item, entry in zip(header.items, entries):
                dtype, shape = codec.parse_meta(item.ids, f"ids of {item.name!r}")
                if dtype != np.int64 or not entry.shape:
                    # Float ids are refused here, not rounded: 2.7 names no row.
                    raise InvalidArgumentError(
                        f"Lookup ids must be int64 and index a variable with rows. Received: "
                        f"ids of dtype {dtype.name} for {entry.describe('variable')}"
                        f"{f' (V={entry.shape[0]} rows)' if entry.shape else ''}."
                    )
                shapes.append((dtype, shape))
            return shapes

        _, ids_arrays = codec.read_stream(frames, layout, "lookup")
        self.store.count_bytes(received=sum(ids.nbytes for ids in ids_arrays))
        for ids, entry in zip(ids_arrays, entries):
            check_row_ids(entry, ids, "the lookup of")
        with locked(entries):
            results = [(np.take(entry.array, ids, axis=0), entry.version)
                       for ids, entry in zip(ids_arrays, entries)]
        header = pb.LookupResponseHeader(results=[
            pb.LookupResult(rows=codec.tensor_meta(rows), version=version)
            for rows, version in results
        ])
        return self._encode(header, [rows for rows, _ in results])

    def _encode(self, header, arrays):
        messages = list(codec.encode_stream(
            header, [codec.byte_view(array) for array in arrays], self.chunk_bytes))
        self.store.count_bytes(sent=sum(array.nbytes for array in arrays))
        return messages

    # -- Optimizers -----------------------------------------------------------------

    def configure_optimizer(self, request):
        resharder = self.autosaver and self.autosaver.reshard
        with self._changing():
            (resharder.configure if resharder else self.store.configure_optimizer)(
                request.config_json, list(request.names))
        return pb.ConfigureOptimizerResponse()

    def optimizer_state(self, request):
        entries = self.store.entries(list(request.names))
        with locked(entries):
            unconfigured = [entry.name for entry in entries if entry.optimizer is None]
            if unconfigured:
                raise FailedPreconditionError(
                    f"Variables {name_list(unconfigured)} have no optimizer; call "
                    "configure_optimizer first."
                )
            states = [(entry.name, *entry.optimizer.state()) for entry in entries]
        header = pb.OptimizerStateHeader(states=[
            pb.VariableOptimizerState(name=name, iterations=iterations, slots=[
                pb.SlotMeta(name=slot_name, value=codec.tensor_meta(value))
                for slot_name, value in slots
            ])
            for name, iterations, slots in states
        ])
        return self._encode(header, [value for _, _, slots in states for _, value in slots])

    def load_optimizer_state(self, frames):
        metas = []

        def layout(header):
            metas.extend(header.states)
            return [codec.parse_meta(slot.value, f"slot {slot.name!r} of {state.name!r}")
                    for state in header.states for slot in state.slots]

        _, arrays = codec.read_stream(frames, layout, "load optimizer state")
        self.store.count_bytes(received=sum(array.nbytes for array in arrays))
        entries = self.store.entries([state.name for state in metas])
        values = iter(arrays)
        states = [(state.iterations, {slot.name: next(values) for slot in state.slots})
                  for state in metas]
        with self._changing(), locked(entries):
            # Every state is checked before any is loaded: all or nothing.
            for entry, (iterations, slots) in zip(entries, states):
                if entry.optimizer is None:
                    raise FailedPreconditionError(
                        f"{entry.describe('Variable')} has no optimizer; call "
                        "configure_optimizer before loading its state."
                    )
                entry.optimizer.check_state(iterations, slots)
            for entry, (iterations, slots) in zip(entries, states):
                entry.optimizer.load_state(iterations, slots)
        return pb.LoadOptimizerStateResponse()

    # -- Checkpoints, counters, health ------------------------------------------------

    def save(self, request):
        return pb.CheckpointResponse(num_variables=checkpoint.save(self.store, request.directory))

    def restore(self, request):
        with self._changing():
            num_variables = checkpoint.restore(self.store, request.directory)
        return pb.CheckpointResponse(num_variables=num_variables)

    def _applying(self):
        return contextlib.nullcontext() if self.autosaver is None else self.autosaver.applying()

    @contextlib.contextmanager
    def _changing(self):
        # What a restarted server could not rebuild is saved before the answer.
        with self._applying():
            yield
        if self.autosaver is not None:
            self.autosaver.after_change()

    def stats(self, request):
        stats = self.store.stats()
        return pb.StatsResponse(
            variables=[
                pb.VariableStatsMessage(
                    name=name, version=item.version, applied_updates=item.applied_updates,
                    rejected_updates=item.rejected_updates, shape=item.shape,
                    dtype=item.dtype, num_bytes=item.num_bytes, sparse_applies=item.sparse_applies,
                    dense_applies=item.dense_applies, rows_updated=item.rows_updated)
                for name, item in stats.variables.items()
            ],
            requests=stats.requests,
            bytes_received=stats.bytes_received,
            bytes_sent=stats.bytes_sent,
            applied_pushes=stats.applied_pushes,
            deduplicated_updates=stats.deduplicated_updates,
            staleness_histogram=stats.staleness.histogram,
        )

    def health(self, request):
        return pb.HealthResponse(status="SERVING", num_variables=len(self.store),
                                 uptime_seconds=time.monotonic() - self.started, pid=os.getpid())


def _gradient_spec(meta):
    check_name(meta.name)
    dtype, shape = codec.parse_meta(meta.values, f"gradient of {meta.name!r}")
    rows = meta.kind == pb.ROWS
    if meta.kind not in (pb.DENSE, pb.ROWS) or meta.num_row_ids < 0:
        raise InvalidArgumentError(
            f"Invalid gradient of {meta.name!r}. Received: kind={meta.kind}, "
            f"num_row_ids={meta.num_row_ids}."
        )
    version = meta.version if meta.HasField("version") else None
    if version is not None and version < 0:
        raise InvalidArgumentError(
            f"A gradient version must be >= 0. Received: version={version} for {meta.name!r}."
        )
    return GradientSpec(meta.name, rows, dtype, shape, meta.num_row_ids, version)
