"""Time limits that scale with the machine the tests run on.

A limit in a test (a ``pytest.mark.timeout``, a deadline, a subprocess timeout) is what the test needs on
the reference machine, a 2-core AMD EPYC Zen 3 with nothing else running. On a slower CPU, or one shared
with other work, the same test takes longer, and a limit that does not grow with it fails a test that was
only slow. ``slowdown()`` measures that factor: a fixed pure-Python loop's wall time against what it took
on the reference machine (which also catches a slower CPU), and the load average per core at the moment
(which catches load that arrives after the session started). ``scaled(s)`` is a limit of ``s`` reference
seconds here; conftest scales every timeout marker with it.

``CHATSVC_TEST_TIME_SCALE`` sets the factor instead (>= 1).
"""

from __future__ import annotations

import functools
import os
import statistics
import time

SCALE_ENV = "CHATSVC_TEST_TIME_SCALE"
LOOP_ITERATIONS = 400_000
# The loop's CPU time on the reference machine (Zen 3, 2.45 GHz, Python 3.11); wall time equals it there
# when idle.
REFERENCE_LOOP_S = 0.028
MAX_SLOWDOWN = 8.0  # beyond this a hung test would take too long to be reported


def _loop_wall_s() -> float:
    started = time.perf_counter()
    x = 0
    for i in range(LOOP_ITERATIONS):
        x += i * i % 7
    return time.perf_counter() - started


@functools.cache
def calibrated_slowdown() -> float:
    """This machine's speed at the session's start against the reference machine's, idle (the median of
    three runs of the loop, about 0.1 s in all there)."""
    return max(1.0, statistics.median(_loop_wall_s() for _ in range(3)) / REFERENCE_LOOP_S)


def load_slowdown() -> float:
    """Runnable work per core over the last minute, where it exceeds one."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def slowdown() -> float:
    forced = os.environ.get(SCALE_ENV)
    if forced:
        return max(1.0, float(forced))
    return min(MAX_SLOWDOWN, max(calibrated_slowdown(), load_slowdown()))


def scaled(seconds: float) -> float:
    """``seconds`` on the reference machine, here and now."""
    return seconds * slowdown()
