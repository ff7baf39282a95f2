"""Which rank is missing? Liveness beacons in the rendezvous store.

Every rank runs one daemon thread that writes `"<beat>:<sequence>"` under its
own key in the job's TCPStore every `HEARTBEAT_INTERVAL_SECONDS`: `beat` counts
the thread's writes, `sequence` is how many collectives the rank has entered.
When a collective fails on a survivor, `Heartbeat.diagnose` reads every rank's
beacon twice, a few intervals apart:

- a beacon that did not move belongs to a rank that died or is frozen;
- a moving beacon whose sequence is behind the survivor's belongs to a rank that
  is alive but has not reached the collective (stalled in user code, or still
  reading data);
- a store that cannot be reached means the rank hosting it (rank 0, unless a
  launcher such as torchrun hosts it) is gone.

The beacons cost one small store write per second per rank, nothing per step.
"""

import dataclasses
import threading
from datetime import timedelta

# One write per second per rank is negligible traffic; a dead rank is then
# recognisable within three intervals.
HEARTBEAT_INTERVAL_SECONDS = 1.0
# How long diagnosis watches the beacons; long enough for a live thread to beat
# twice even on a loaded machine.
DIAGNOSIS_WINDOW_SECONDS = 3 * HEARTBEAT_INTERVAL_SECONDS
# Store operations made while diagnosing must not hang themselves.
STORE_TIMEOUT_SECONDS = 10.0

_KEY = "kdist/{attempt}/heartbeat/{rank}"  # `Rendezvous.attempt`: one set of keys per start


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What the survivors could tell about the other ranks.

    Attributes:
        dead: ranks whose beacon stopped (process died or is frozen).
        stalled: `{rank: sequence}` for live ranks behind the caller's sequence.
        store_unreachable: the rendezvous store itself could not be reached.
    """

    dead: tuple = ()
    stalled: dict = dataclasses.field(default_factory=dict)
    store_unreachable: bool = False

    @property
    def missing_ranks(self):
        return tuple(sorted(set(self.dead) | set(self.stalled)))

    def describe(self, store_host_rank):
        parts = []
        if self.store_unreachable:
            parts.append(
                f"the rendezvous store is unreachable, so rank {store_host_rank} (which hosts "
                "it) has most likely exited"
                if store_host_rank is not None
                else "the rendezvous store (hosted by the launcher) is unreachable"
            )
        if self.dead:
            parts.append(f"rank(s) {list(self.dead)} stopped responding (process exited or frozen)")
        for rank, sequence in sorted(self.stalled.items()):
            parts.append(
                f"rank {rank} is alive but stalled before this collective (it has entered "
                f"{sequence} collective(s))"
            )
        return "; ".join(parts) or "every rank is still alive and at this collective"


class Heartbeat:
    """Publishes this rank's beacon and diagnoses the others'.

    Thread-safe: `enter_collective` is called by the training thread, the beacon
    thread only reads the counter.

    Args:
        host, port: the rendezvous TCPStore.
        rank, world_size: this process's rank and the number of ranks.
        attempt: the job's start (`Rendezvous.attempt`): beacons of an
            earlier start left in a store that outlived it are never read.
    """

    def __init__(self, host, port, rank, world_size, attempt=0):
        self._attempt = attempt
        self._host = host
        self._port = port
        self._rank = rank
        self._world_size = world_size
        self._sequence = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kdist-heartbeat-{rank}", daemon=True)
        self._thread.start()

    @property
    def sequence(self):
        return self._sequence

    def enter_collective(self):
        """Counts one more collective entered by this rank; returns its sequence number."""
        self._sequence += 1
        return self._sequence

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_INTERVAL_SECONDS)

    def _connect(self):
        import torch.distributed as dist

        return dist.TCPStore(
            self._host,
            self._port,
            is_master=False,
            timeout=timedelta(seconds=STORE_TIMEOUT_SECONDS),
        )

    def _run(self):
        try:
            store = self._connect()
        except Exception:  # noqa: BLE001 - no store, no beacon; diagnosis says so
            return
        beat = 0
        key = _KEY.format(attempt=self._attempt, rank=self._rank)
        while not self._stop.is_set():
            beat += 1
            try:
                store.set(key, f"{beat}:{self._sequence}")
            except Exception:  # noqa: BLE001 - the store host died; nothing left to publish to
                return
            self._stop.wait(HEARTBEAT_INTERVAL_SECONDS)

    def diagnose(self):
        """Watches every other rank's beacon for `DIAGNOSIS_WINDOW_SECONDS`; returns a `Diagnosis`."""
        try:
            store = self._connect()
            first = self._read(store)
            threading.Event().wait(DIAGNOSIS_WINDOW_SECONDS)
            second = self._read(store)
        except Exception:  # noqa: BLE001 - any store failure means the store host is gone
            return Diagnosis(store_unreachable=True)
        dead, stalled = [], {}
        for rank in range(self._world_size):
            if rank == self._rank:
                continue
            before, after = first.get(rank), second.get(rank)
            if after is None or before == after:
                dead.append(rank)
            elif after[1] < self._sequence:
                stalled[rank] = after[1]
        return Diagnosis(dead=tuple(dead), stalled=stalled)

    def _read(self, store):
        beacons = {}
        for rank in range(self._world_size):
            key = _KEY.format(attempt=self._attempt, rank=rank)
            if store.check([key]):
                beat, sequence = store.get(key).decode().split(":")
                beacons[rank] = (int(beat), int(sequence))
        return beacons
