"""The cyclic garbage collector, paused for the length of a simulation.

A 20k-job run allocates millions of short-lived objects (step samples, views, memos, book
records) and creates no reference cycles (none left after the 20k run; test_sim_nogc.py checks
a small one), but every 700 container allocations CPython's collector walks the young objects
and, now and then, every object of the heap (568, 50 and 5 collections of generations 0-2 per
20k run): all of that work found nothing. Reference counting still frees every object at once,
so memory stays as it was (peak RSS 84 MiB either way on the 20k run); a cycle made by a caller
meanwhile is collected once the collector runs again. Results do not depend on it: nothing in
the simulator has a finaliser or a weak reference.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block; restore its state after, even on error."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
