"""Builds MultiWorkerMirroredStrategy twice on one line, as a script started with plain `python`.

single_worker.py            -- the resolver from the environment
single_worker.py --explicit -- cluster_resolver=kdist.cluster.local_cluster_resolver()

Prints "REPLICAS n" after both. Python's default warning filters are on, as
for any script, so what stderr shows is what a user sees.
"""

import sys

import kdist

explicit = "--explicit" in sys.argv[1:]
for _ in range(2):
    resolver = kdist.cluster.local_cluster_resolver() if explicit else None
    strategy = kdist.MultiWorkerMirroredStrategy(cluster_resolver=resolver)  # WARNED LINE
print(f"REPLICAS {strategy.num_replicas_in_sync}", flush=True)
