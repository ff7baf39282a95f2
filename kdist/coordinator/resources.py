"""Chief-side resources of a coordinator: what closures reference and workers build once.

A scheduled closure's pickle may reference objects created on the chief: the
strategy, models, optimizers, metrics, variables (turned into resources by the
describers `kdist.keras` registers) and per-worker datasets and iterators
(registered explicitly). Each becomes a resource with an id; the closure
carries only its id, and a worker builds the resource once per session, after
the resources it depends on.
"""

import itertools
import threading

from kdist.coordinator import payload

RESOURCE_REFERENCE = "kdist.resource"
# Objects that pickle as themselves: `reference` skips the describers for them.
_PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes, tuple, list, dict, range, slice})

# Describers turn chief-side objects into resources: `(predicate, describe)`,
# where `describe(obj, coordinator) -> (kind, spec, merge)`. `spec` is pickled
# (its own references to other resources become dependencies); `merge`, when
# not None, makes it a metric: `merge(obj, arrays)` adds a closure's state.
_describers = []


def register_describer(predicate, describe):
    """Teaches coordinators to send objects for which `predicate(obj)` holds as resources."""
    _describers.append((predicate, describe))


class Resource:
    def __init__(self, resource_id, obj, kind, spec, dependencies, merge):
        self.id = resource_id
        self.obj = obj
        self.kind = kind
        self.spec = spec
        self.dependencies = dependencies
        self.merge = merge


class Registry:
    """Chief-side resources by id, in definition order (dependencies first)."""

    def __init__(self, coordinator):
        self._coordinator = coordinator
        self._by_object = {}
        self._resources = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()

    def add(self, obj, kind, spec, merge=None):
        """Registers `obj` explicitly (per-worker datasets and iterators)."""
        with self._lock:
            return self._add(obj, kind, spec, merge)

    def _add(self, obj, kind, spec, merge):
        referenced = []
        spec_payload = payload.dumps(spec, self._resolver(referenced))
        resource = Resource(next(self._ids), obj, kind, spec_payload, tuple(referenced), merge)
        self._resources[resource.id] = resource
        self._by_object[id(obj)] = resource.id
        return resource

    def get(self, resource_id):
        return self._resources[resource_id]

    def reference(self, obj, referenced):
        """The reference standing in for `obj` in a pickle, or None when `obj` pickles as itself."""
        if type(obj) in _PLAIN_TYPES:  # most of a pickle; never a resource
            return None
        with self._lock:
            resource_id = self._by_object.get(id(obj))
            if resource_id is not None and self._resources[resource_id].obj is obj:
                referenced.append(resource_id)
                return (RESOURCE_REFERENCE, resource_id)
            for predicate, describe in _describers:
                if predicate(obj):
                    kind, spec, merge = describe(obj, self._coordinator)
                    resource = self._add(obj, kind, spec, merge)
                    referenced.append(resource.id)
                    return (RESOURCE_REFERENCE, resource.id)
        return None

    def _resolver(self, referenced):
        return lambda obj: self.reference(obj, referenced)

    def dumps(self, obj):
        """`obj` as a `Payload`, and the ids of the resources it references."""
        referenced = []
        return payload.dumps(obj, self._resolver(referenced)), referenced

    def closure(self, resource_ids):
        """`resource_ids` and everything they depend on, dependencies first."""
        ordered, seen = [], set()

        def visit(resource_id):
            if resource_id in seen:
                return
            seen.add(resource_id)
            for dependency in self._resources[resource_id].dependencies:
                visit(dependency)
            ordered.append(resource_id)

        for resource_id in resource_ids:
            visit(resource_id)
        return ordered
