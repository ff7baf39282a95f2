"""A server's large tables and slots live in memory advised for 2 MiB pages; values never change."""

import mmap
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import torch

from kdist.ps.server import memory
from kdist.ps.server.store import GradientSpec, VariableStore

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not sys.platform.startswith("linux")
                       or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                       reason="transparent huge pages are a Linux kernel feature, absent here"),
]


def _glibc():
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


glibc_only = pytest.mark.skipif(not _glibc(), reason="the malloc settings are glibc's (mallopt)")
SMALL_THRESHOLD = 4 << 20
# Above glibc's largest mmap threshold (32 MiB): each tensor gets fresh pages of its own, as
# real tables do, not heap memory an earlier advised tensor left behind.
ROWS = 3 << 20  # x 4 float32 columns: 48 MiB


def _advised(tensor):
    """Whether the mapping holding the middle of `tensor` is advised for huge pages (VmFlags `hg`)."""
    address = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
    inside = False
    with open("/proc/self/smaps") as handle:
        for line in handle:
            bounds = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if bounds:
                inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds address {address:#x}")


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setattr(memory, "MIN_BYTES", SMALL_THRESHOLD)


def test_a_large_tensor_is_copied_into_advised_memory(small_threshold):
    # The original sits in a mapping of its own, never advised: heap memory could have been
    # advised by an earlier test's NumPy array, once a server in this process keeps freed memory.
    mapping = mmap.mmap(-1, 48 << 20)
    tensor = torch.frombuffer(mapping, dtype=torch.float32)
    tensor.copy_(torch.arange(tensor.numel(), dtype=torch.float32))
    moved = memory.moved(tensor)
    assert moved is not tensor and moved.data_ptr() != tensor.data_ptr()
    assert torch.equal(moved, tensor)
    assert _advised(moved)
    assert not _advised(tensor)  # the control: the same check on memory nobody advised
    cloned = memory.clone(moved)
    assert torch.equal(cloned, tensor) and cloned.data_ptr() != moved.data_ptr() and _advised(cloned)


def test_a_small_tensor_stays_where_it_is():
    tensor = torch.arange(1000, dtype=torch.float32)
    assert memory.moved(tensor) is tensor
    cloned = memory.clone(tensor)
    assert torch.equal(cloned, tensor) and cloned.data_ptr() != tensor.data_ptr()


def _adagrad_store(initial):
    store = VariableStore()
    store.create([("table", initial.copy(), True)])
    store.configure_optimizer(keras.optimizers.serialize(keras.optimizers.Adagrad(0.1)), ["table"])
    return store


def _push(store, ids, rows):
    spec = GradientSpec("table", True, rows.dtype, rows.shape, ids.size)
    store.apply_update(store.plan_update([spec], []), [ids.astype(np.int64), rows])


def test_a_servers_table_and_its_slots_are_advised_and_train_the_same(small_threshold, monkeypatch):
    rng = np.random.default_rng(0)
    initial = rng.standard_normal((ROWS, 4)).astype("float32")
    pushes = [(rng.integers(0, ROWS, 64), rng.standard_normal((64, 4)).astype("float32")) for _ in range(5)]
    advised_store = _adagrad_store(initial)
    [entry] = advised_store.entries(["table"])
    [accumulator] = entry.optimizer.slots
    assert _advised(entry.variable.value) and _advised(accumulator.value)
    monkeypatch.setattr(memory, "MIN_BYTES", 1 << 62)
    plain_store = _adagrad_store(initial)
    [plain] = plain_store.entries(["table"])
    for ids, rows in pushes:
        _push(advised_store, ids, rows)
        _push(plain_store, ids, rows)
    np.testing.assert_array_equal(entry.array, plain.array)
    np.testing.assert_array_equal(accumulator.value.numpy(), plain.optimizer.slots[0].value.numpy())
    assert entry.array.ctypes.data == entry.variable.value.data_ptr()  # the store reads what is updated


def test_memory_a_server_moves_its_table_to_stays_advised(small_threshold):
    # The copy-on-write clone is made with torch, and moved; an array assigned whole is
    # NumPy's, which NumPy advises itself.
    initial = np.zeros((ROWS, 4), "float32")
    store = _adagrad_store(initial)
    [entry] = store.entries(["table"])
    with entry.lock:
        token, _ = entry.share()  # a pull streaming the value: the next write moves it
        entry.before_update()
    entry.release(token)
    assert _advised(entry.variable.value)
    with entry.lock:
        entry.replace_value(np.ones((ROWS, 4), "float32"))
    assert _advised(entry.variable.value) and float(entry.array.sum()) == 4 * ROWS


_STEPS_OF_TEMPORARIES = """
import sys, torch
if sys.argv[1] == "keep":
    from kdist.ps.server import memory
    assert memory.keep_freed_memory()
def minor_faults():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
rows = torch.rand(5000, 64)
table = torch.rand(40_000_000)  # a table-sized block, mapped on its own and freed
del table
before = minor_faults()
for step in range(300):  # a sparse Adagrad apply's temporaries: ~0.6 MB each, sizes varying
    gathered = rows.index_select(0, torch.randint(0, 5000, (2500 + step % 80,)))
    update = gathered / ((gathered * gathered + 1.0).sqrt())
print((minor_faults() - before) / 300)
"""


@glibc_only
def test_a_servers_step_temporaries_reuse_memory_instead_of_faulting_it_in():
    def faults_per_step(mode):
        completed = subprocess.run([sys.executable, "-c", _STEPS_OF_TEMPORARIES, mode], capture_output=True,
                                   text=True, timeout=60, check=True)
        return float(completed.stdout)

    default, kept = faults_per_step("default"), faults_per_step("keep")
    assert default > 20  # the control: glibc maps and unmaps each block, faulting its pages in
    assert kept < default / 3, (default, kept)


@glibc_only
def test_create_server_keeps_freed_memory():
    code = ("from kdist.ps import create_server\nfrom kdist.ps.server import memory\n"
            "server = create_server()\nprint(memory._kept)\nserver.stop()")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert completed.stdout.strip().splitlines()[-1] == "True"
