"""How a parameter server's memory is laid out, so a step's cost does not grow with its tables.

A step reads and updates a few thousand rows scattered over table shards of
up to gigabytes. Two things made that cost grow with the table (measured on
2 cores, issue 23's model, Adagrad, V = 10^7, 2 ps, between-graph `fit`):

- **A step's temporaries were page-faulted in anew every time.** The rows a
  push gathers, and Keras' update on them, make tensors of about 0.6 MB. glibc
  serves blocks that large with a fresh `mmap` and returns them on `free`, so
  each step faulted in and zeroed ~900 pages per server (4 at V = 10^4, where
  the blocks were just small enough for the heap). `keep_freed_memory` makes
  glibc keep such blocks for reuse: every block under 32 MiB comes from the
  heap, and up to 256 MiB freed at its top is kept rather than trimmed. The
  servers' CPU per step fell from 6.1-7.7 ms to 4.4-5.7 ms.
- **Random rows cost a TLB miss each.** A 1.28 GB shard has 2.5 MB of page
  tables; 2 MiB pages make the walk cheap. Linux gives them to memory advised
  with `madvise(MADV_HUGEPAGE)` before it is first written (transparent huge
  pages in `madvise` or `always` mode). NumPy already advises its large
  arrays, which hold the tables (made, received, restored); the tensors a
  server makes with torch (an optimizer's slots, a copy-on-write clone) are
  moved once, when made, into fresh advised memory (`moved`, `clone`,
  `move_variable`).

Both change where memory comes from, never a value. Elsewhere (another C
library, another system, THP off, a small tensor) nothing changes. The price
of the first: a server's process keeps up to 256 MiB of freed memory at the
top of each malloc arena, and blocks under 32 MiB are never returned to the
system one by one.
"""

import ctypes
import sys

import torch

MIN_BYTES = 64 << 20  # below this a tensor's page tables fit the cache anyway
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest
_TRIM_THRESHOLD = 256 << 20
_libc = None
_kept = False


def _c_library():
    """The process's C library with `madvise` and `mallopt` typed, or False (not Linux, or lacking them)."""
    global _libc
    if _libc is None:
        library = False
        if sys.platform.startswith("linux"):
            try:
                library = ctypes.CDLL(None, use_errno=True)
                library.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                library.madvise.restype = ctypes.c_int
                library.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                library.mallopt.restype = ctypes.c_int
            except (OSError, AttributeError):
                library = False
        _libc = library
    return _libc


def keep_freed_memory():
    """Makes glibc keep freed blocks under 32 MiB for reuse, process-wide (see module doc). Idempotent.

    Returns:
        Whether the C library took both settings (False under another C
        library or allocator, whose `mallopt` refuses or ignores them).
    """
    global _kept
    library = _c_library()
    if not _kept and library:
        mapped = library.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        trimmed = library.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
        _kept = bool(mapped and trimmed)
    return _kept


def _applies(tensor):
    return (tensor.device.type == "cpu" and tensor.layout == torch.strided
            and tensor.numel() * tensor.element_size() >= MIN_BYTES and bool(_c_library()))


def _advised_copy(tensor):
    fresh = torch.empty(tensor.shape, dtype=tensor.dtype)  # not yet written: no page faulted in
    start = fresh.data_ptr()
    end = start + fresh.numel() * fresh.element_size()
    first = (start + _HUGE_PAGE - 1) // _HUGE_PAGE * _HUGE_PAGE
    length = (end - first) // _HUGE_PAGE * _HUGE_PAGE
    if length > 0:
        _c_library().madvise(first, length, _MADV_HUGEPAGE)  # advice only: a refusal leaves 4 KiB pages
    with torch.no_grad():
        return fresh.copy_(tensor)


def moved(tensor):
    """`tensor` itself, or for a large CPU tensor a contiguous copy in memory advised for huge pages."""
    return _advised_copy(tensor) if _applies(tensor) else tensor


def clone(tensor):
    """A copy of `tensor` (`torch.Tensor.clone`), in memory advised for huge pages when large."""
    return _advised_copy(tensor) if _applies(tensor) else tensor.clone()


def move_variable(variable):
    """Moves a Keras variable's torch value into advised memory when large (in place: same tensor object)."""
    value = variable.value
    data = moved(value.data)
    if data is not value.data:
        value.data = data
