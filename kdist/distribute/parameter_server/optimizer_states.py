"""Optimizer state of routed variables, whole on the workers, per shard on the servers.

A partitioned variable's slots are split along axis 0 like the variable itself
(`ShardPlacement.shard_part`); every shard's optimizer counts the same
iterations. `gather` joins what the servers hold into one state per variable
(read back before a save), `split` cuts one state per variable into the
servers' requests (a backup's state loaded onto any number of servers).
"""

import numpy as np

from kdist.ps import OptimizerState


def gather(routes, per_server):
    """One `(iterations, {slot name: whole array})` per route, from the servers' answers.

    Args:
        routes: `Route`s.
        per_server: each server's name -> `OptimizerState` (`VariableClient.optimizer_state`).
    """
    states = {}
    for answer in per_server:
        states.update(answer)
    gathered = []
    for route in routes:
        shards = [states[key] for key in route.keys]
        iterations = max(state.iterations for state in shards)
        slots = {
            name: np.concatenate([state.slots[name] for state in shards]) if len(shards) > 1 else shards[0].slots[name]
            for name in shards[0].slots
        }
        gathered.append((iterations, slots))
    return gathered


def split(routes, states):
    """`{ps_index: {server key: OptimizerState}}` setting each route's shards from `states`.

    Args:
        routes: `Route`s.
        states: one `(iterations, {slot name: whole array})` per route.
    """
    requests = {}
    for route, (iterations, slots) in zip(routes, states):
        placement = route.placement
        for position, shard in enumerate(placement.shards):
            parts = {name: np.ascontiguousarray(placement.shard_part(position, np.asarray(value)))
                     for name, value in slots.items()}
            requests.setdefault(shard.ps_index, {})[route.keys[position]] = OptimizerState(int(iterations), parts)
    return requests
