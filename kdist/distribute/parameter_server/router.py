"""The worker's view of variables that live on parameter servers.

Every variable created in a `ParameterServerStrategy` scope keeps a local
Keras variable (the model computes with it, and a saved `.keras` file holds
it) plus a `Route` here (`kdist.distribute.parameter_server.route`): where its
shards live, their server keys, the server version each shard was last read
at, and whether lookups replace dense reads (embedding tables).

All traffic goes through `kdist.ps.VariableClient`. A call that touches
several parameter servers sends one request to each, in parallel: a step
costs one round trip per server for its pull and one for its push.

Thread-safety: `VariableRouter` may be used from several threads; each route
is written by the thread that runs the model's step.

Exactly-once pushes: a push may carry an update id, and each parameter server
applies a given id once (see `VariableClient.push`). `idempotent_updates`
numbers a thread's pushes, so that a closure re-run after its worker died
repeats the dead worker's ids and its pushes that were delivered are not
applied twice.

The way of a gradient, stage by stage ("push" is the RPC, `Push`; each stage
has its own name):

1. router (here): `VariableRouter.send_gradients` cuts each variable's
   gradient into its shards' parts (`VariablePlacement.shard_part`, row ids
   by owner via `kdist.distribute.parameter_server.rows`) as
   `kdist.ps.DenseGradient` / `RowGradient` values, one batch per server.
2. client: `kdist.ps.VariableClient.push` sends one batch (the `Push` RPC).
3. payload: `kdist.ps.client.payload.encode_gradient` turns each value into
   a `GradientMeta` header entry plus the arrays it carries.
4. codec: `kdist.ps.wire.codec.encode_stream` frames header and arrays into
   chunked stream messages; on the server, `codec.read_stream` decodes them
   into arrays laid out as the header announced.
5. servicer: `kdist.ps.server.servicer.VariableServicer.push` (the RPC handler)
   reads the header into `GradientSpec`s.
6. store: `VariableStore.plan_update` validates the whole request before
   anything changes; `VariableStore.apply_update` applies it, at most once per
   update id, variable by variable under each variable's lock.
7. optimizer host: `kdist.ps.server.optimizer_host.VariableOptimizer.apply` runs the
   variable's own Keras optimizer on the (dense) gradient.
"""

import concurrent.futures
import contextlib
import itertools
import threading

import numpy as np

from kdist.distribute.parameter_server import optimizer_states
from kdist.distribute.parameter_server.route import Route, RouteReader, keys_by_server, server_keys, to_numpy
from kdist.errors import InvalidArgumentError
from kdist.ps import Assignment, DenseGradient, RowGradient
from kdist.ps.wire.conventions import CONFIG_KEY as SPARSE_UPDATES_KEY
from kdist.ps.wire.values import check_update_id
from kdist.rpc import dtypes

__all__ = ["Route", "RouteReader", "VariableRouter"]


class VariableRouter:
    """Creates, reads, updates and looks up variables on a job's parameter servers.

    Args:
        addresses: `host:port` of every `ps` task, by task index.
        options: `kdist.ps.ServiceOptions` for every client, or None.
        security: `kdist.ps.Security` (token, TLS), or None.
    """

    def __init__(self, addresses, options=None, security=None):
        # Imported here: the client loads gRPC, which `import kdist.distribute` must not.
        from kdist.ps.client.variable_client import VariableClient

        self._clients = [VariableClient(address, options=options, security=security) for address in addresses]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, len(self._clients)), thread_name_prefix="kdist-ps"
        )
        self._routes = {}
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._update_ids = threading.local()  # .block: this thread's _UpdateIdBlock or None

    @property
    def clients(self):
        """One `kdist.ps.VariableClient` per parameter server, by task index."""
        return tuple(self._clients)

    # ----- creation ---------------------------------------------------------------
    def register(self, variable, placement, initializer_json=None):
        """Creates `variable`'s shards on their servers; the local copy takes the servers' value.

        Idempotent across workers: the first creator's value wins, so every
        worker starts from the same weights.

        With `initializer_json` (`kdist.ps.server.server_init`), a table that lives on
        the servers only (`Route.remote`): they compute its value; the local
        variable is neither read nor written; steps read it by rows.
        """
        with self._lock:
            index = next(self._counter)
        # Keyed by creation order, not by name (see `route.server_keys`).
        keys = server_keys(index, placement)
        remote = initializer_json is not None
        route = Route(variable, placement, keys, [0] * len(keys), row_sparse=remote, remote=remote)
        requests = route.create_requests(initializer_json)
        results = self._per_server(requests, lambda client, items: client.create([item for _, item in items]))
        for ps_index, items in requests.items():
            for (position, _), state in zip(items, results[ps_index]):
                if not remote:
                    route.write_shard(position, state.value)
                route.versions[position] = state.version
        if not remote:
            route.take_snapshot()
        with self._lock:
            self._routes[id(variable)] = route
        return route

    def adopt(self, variable, placement, keys):
        """Binds a local `variable` to shards that already exist on the servers (creates nothing).

        A worker driven by a coordinator rebuilds the chief's model and adopts
        the chief's keys; its first `pull` reads every value (versions start
        unknown).
        """
        route = Route(variable, placement, tuple(keys), [-1] * len(keys))
        with self._lock:
            self._routes[id(variable)] = route
        return route

    def all_routes(self):
        """Every route of this store, in registration order."""
        with self._lock:
            return list(self._routes.values())

    def route(self, variable):
        """The `Route` of `variable`, or None when it does not live on a parameter server."""
        route = self._routes.get(id(variable))
        return route if route is not None and route.variable is variable else None

    def routes(self, variables):
        """Routes of those `variables` that live on parameter servers, in order, without repeats."""
        seen, result = set(), []
        for variable in variables:
            route = self.route(variable)
            if route is not None and id(route) not in seen:
                seen.add(id(route))
                result.append(route)
        return result

    # ----- reads ------------------------------------------------------------------
    def pull(self, routes, *, include_row_sparse=False, only_changed=True):
        """Reads the servers' values into the local copies (one request per server)."""
        requests = {}
        for route in routes:
            if (route.row_sparse and not include_row_sparse) or route.remote:  # a remote table has no local copy
                continue
            for position, shard in enumerate(route.placement.shards):
                requests.setdefault(shard.ps_index, []).append((route, position))

        def pull_from(client, items):
            names = [route.keys[position] for route, position in items]
            known = {route.keys[position]: route.versions[position] for route, position in items} if only_changed else None
            # Values land straight in the local variables' memory (no copy).
            out = {name: view for name, (route, position) in zip(names, items) if (view := route.local_view(position)) is not None}
            try:
                return client.pull(names, known_versions=known, out=out), out
            except Exception:
                # A pull that failed part-way may have overwritten some local
                # values: forget their versions so the next pull resends them.
                for route, position in items:
                    route.versions[position] = -1
                raise

        results = self._per_server(requests, pull_from)
        for ps_index, items in requests.items():
            states, out = results[ps_index]
            for (route, position), state in zip(items, states):
                if state.value is not None and state.value is not out.get(route.keys[position]):
                    route.write_shard(position, state.value)
                route.versions[position] = state.version
        for route in routes:
            route.take_snapshot()

    def lookup(self, route, row_ids):
        """Rows `row_ids` (unique, int64, 1-D) of `route`'s table, read from the shards that own them.

        Returns:
            `(rows, versions)`: a tensor of `len(row_ids)` rows (the table's
            dtype) on the CPU and the version of each shard that answered (by
            shard position).
        """
        groups = route.placement.shard_for_rows(row_ids)
        requests = [(group.shard_index, group.local_ids) for group in groups]
        rows = np.empty((len(row_ids),) + tuple(route.placement.shape[1:]), dtype=dtypes.numpy_dtype(route.placement.dtype))
        versions = {}
        for group, (values, version) in zip(groups, self.lookup_shards(route, requests)):
            rows[group.positions] = values
            versions[group.shard_index] = version
        return dtypes.to_torch(rows), versions

    def lookup_shards(self, route, requests):
        """Rows of `route`'s shards: `[(shard position, local ids)]` -> `[(rows, version)]`, one request per server."""
        by_server = {}
        for index, (position, local_ids) in enumerate(requests):
            by_server.setdefault(route.placement.shards[position].ps_index, []).append((index, route.keys[position], local_ids))
        results = self._per_server(by_server, lambda client, items: client.lookup([(key, ids) for _, key, ids in items]))
        answers = [None] * len(requests)
        for ps_index, items in by_server.items():
            for (index, _, _), answer in zip(items, results[ps_index]):
                answers[index] = answer
        return answers

    def read_shards(self, route, positions):
        """Current server values of `route`'s shards at `positions` (the local copy is untouched)."""
        by_server = {}
        for index, position in enumerate(positions):
            by_server.setdefault(route.placement.shards[position].ps_index, []).append((index, route.keys[position]))
        results = self._per_server(by_server, lambda client, items: client.pull([key for _, key in items]))
        values = [None] * len(positions)
        for ps_index, items in by_server.items():
            for (index, _), state in zip(items, results[ps_index]):
                values[index] = state.value
        return values

    # ----- writes -----------------------------------------------------------------
    def send_gradients(self, dense, rows=(), assign=(), update_id=None, outcome=b""):
        """Sends one update to every server it concerns, in parallel (stage 1 of a push).

        Args:
            dense: `(route, gradient tensor)` pairs, full-variable gradients.
            rows: `(route, unique row ids, row gradients, shard versions)`.
            assign: routes whose local value replaces the servers' value.
            update_id: an idempotency key sent to every server contacted; each
                applies it once (see `kdist.ps.VariableClient.push`). None:
                the next id of this thread's `idempotent_updates` block, or
                no id outside one.
            outcome: bytes every server keeps with the id (`VariableClient.push`).

        Returns:
            A list of `kdist.ps.PushResult`, one per server contacted.

        Raises:
            kdist.errors.InvalidArgumentError: an `update_id` that is not a
                string of at most 256 characters.
        """
        if update_id is None:
            block = getattr(self._update_ids, "block", None)
            update_id = None if block is None else block.next_id()
        check_update_id(update_id)
        requests, assigned = {}, {}  # assigned: ps index -> (route, position) of local values sent
        for route, gradient in dense:
            gradient = to_numpy(gradient)
            for position, shard in enumerate(route.placement.shards):
                update = DenseGradient(route.keys[position], route.placement.shard_part(position, gradient), route.versions[position])
                requests.setdefault(shard.ps_index, ([], []))[0].append(update)
        for route, row_ids, values, versions in rows:
            values = to_numpy(values)
            for group in route.placement.shard_for_rows(row_ids):
                position = group.shard_index
                update = RowGradient(route.keys[position], group.local_ids, values[group.positions], versions.get(position, route.versions[position]))
                requests.setdefault(route.placement.shards[position].ps_index, ([], []))[0].append(update)
        for item in assign:
            # A route (its local value), or `(route, value)` for a table that lives on the servers only.
            route, value = item if isinstance(item, tuple) else (item, to_numpy(item.variable.value))
            value = to_numpy(value)
            for position, shard in enumerate(route.placement.shards):
                assignment = Assignment(route.keys[position], route.placement.shard_part(position, value))
                requests.setdefault(shard.ps_index, ([], []))[1].append(assignment)
                assigned.setdefault(shard.ps_index, []).append((route, position))
        results = self._per_server(requests, lambda client, pair: client.push(*pair, update_id=update_id, outcome=outcome))
        for ps_index, result in results.items():
            # A repeat applied nothing: the next pull reads again what this step assigned locally.
            for route, position in assigned.get(ps_index, ()) if result.deduplicated else ():
                route.versions[position] = -1
        return list(results.values())

    @contextlib.contextmanager
    def idempotent_updates(self, prefix):
        """Gives this thread's pushes in the block the update ids `f"{prefix}/{n}"`.

        `n` counts, from 0, the pushes made in the block without an explicit
        `update_id`. Every server applies an id once, so a closure that is
        re-run (its first worker died, maybe after pushing some of its
        updates) with the same prefix makes the same pushes in the same order
        under the same ids, and those the dead worker delivered are not
        applied again: the servers answer them with the first results and
        count them in `ServerStats.deduplicated_updates`.

        Thread-local. A nested block uses its own prefix and count until it exits.

        Args:
            prefix: a non-empty string naming the closure (not the attempt),
                short enough that the ids fit in 256 characters.

        Raises:
            kdist.errors.InvalidArgumentError: an empty or non-string prefix.

        Example:

        >>> with variable_router.idempotent_updates("closure-17"):  # doctest: +SKIP
        ...     variable_router.send_gradients(gradients)  # update_id "closure-17/0"
        ...     variable_router.send_gradients(gradients)  # update_id "closure-17/1"
        """
        if not isinstance(prefix, str) or not prefix:
            raise InvalidArgumentError("idempotent_updates() needs a non-empty string prefix naming "
                                       f"the closure. Received: prefix={prefix!r}.")
        outer = getattr(self._update_ids, "block", None)
        self._update_ids.block = _UpdateIdBlock(prefix)
        try:
            yield
        finally:
            self._update_ids.block = outer

    def in_idempotent_block(self):
        """True inside this thread's `idempotent_updates` block (a closure's pushes)."""
        return getattr(self._update_ids, "block", None) is not None

    def assign(self, routes):
        """Writes the local values of `routes` to their servers (restoring weights, for instance).

        Tables that live on the servers only are skipped: `assign_whole` writes them.
        """
        routes = [route for route in routes if not route.remote]
        self.send_gradients((), (), assign=routes)
        self.pull(routes, include_row_sparse=True)

    def assign_whole(self, route, value):
        """Replaces the servers' value of `route` by `value` (the whole variable), as one update."""
        self.send_gradients((), (), assign=[(route, value)])
        route.versions[:] = [-1] * len(route.versions)

    def read_whole(self, route):
        """The servers' current value of the whole of `route` (NumPy), fetched shard by shard."""
        parts = self.read_shards(route, range(route.placement.num_shards))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    # How servers apply row gradients (`kdist.ps.server.row_updates`); the strategy's
    # `sparse_updates` argument sets it. "exact" sends the config unchanged.
    sparse_updates = "exact"

    def configure_optimizer(self, config, routes):
        """Tells each server which optimizer applies the pushes to `routes`' shards."""
        if self.sparse_updates != "exact":
            config = {**config, SPARSE_UPDATES_KEY: self.sparse_updates}
        self._per_server(keys_by_server(routes), lambda client, names: client.configure_optimizer(config, names))

    def optimizer_state(self, routes):
        """Reads back the servers' optimizer state of `routes`.

        Returns:
            A list, one item per route: `(iterations, {slot name: full array})`;
            a partitioned variable's slots are its shards' slots concatenated.
        """
        results = self._per_server(keys_by_server(routes), lambda client, names: client.optimizer_state(names))
        return optimizer_states.gather(routes, results.values())

    def load_optimizer_state(self, routes, states):
        """Sets the servers' optimizer state of `routes` (configured) from `states`, as read above."""
        requests = optimizer_states.split(routes, states)
        self._per_server(requests, lambda client, part: client.load_optimizer_state(part))

    def stats(self):
        """`kdist.ps.ServerStats` of every parameter server, by task index."""
        return [client.stats() for client in self._clients]

    def close(self):
        """Closes every channel and the worker threads. Idempotent."""
        for client in self._clients:
            client.close()
        self._pool.shutdown(wait=False)

    # ----- helpers ------------------------------------------------------------------
    def _per_server(self, requests, call):
        """Runs `call(client, payload)` for every `{ps_index: payload}` concurrently."""
        if len(requests) == 1:
            ((ps_index, payload),) = requests.items()
            return {ps_index: call(self._clients[ps_index], payload)}
        futures = {ps_index: self._pool.submit(call, self._clients[ps_index], payload) for ps_index, payload in requests.items()}
        return {ps_index: future.result() for ps_index, future in futures.items()}

    @staticmethod
    def changed(route):
        """True when a non-trainable route's local value differs from what was last read."""
        return route.changed()

    def reader(self, route):
        """A `sharded_variable.VariableReader` of `route`'s shards, which also knows their server keys."""
        return RouteReader(self, route)


class _UpdateIdBlock:
    """The ids of one `idempotent_updates` block: `prefix/0`, `prefix/1`, ... (one thread's)."""

    def __init__(self, prefix):
        self.prefix = prefix
        self._count = itertools.count()

    def next_id(self):
        return f"{self.prefix}/{next(self._count)}"
