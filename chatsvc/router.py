"""Which worker runs a request: session affinity, persona affinity, least loaded, under a load bound.

Pure decision logic over the workers' last heartbeats (``engine.streams.Beat``); the gateway's
``RemoteEngine`` feeds it and keeps the session -> worker records in Redis.

* ``session``: the session's previous turn ran on a worker that is alive and within the load bound: its
  blocks (the whole conversation so far) are cached there, so the next prompt is mostly a cache hit. The
  record names the worker's KV home (``Beat.home``): with a disk tier that is its directory, so a worker
  restarted on it (a new process, a new id) still gets the sessions whose blocks it can read back.
* ``persona``: a new session (or one whose worker is gone or over the bound) whose prompt starts with a
  pinned prefix goes to the least loaded worker that has that prefix pinned and is within the bound.
* ``load``: otherwise the least loaded worker (running + waiting requests, then the most free blocks).
* ``failover``: a request re-dispatched because its worker died, placed as ``load`` would place it.
* ``random``: the ``random`` policy, which ignores affinity (a baseline for benchmarks).

Bounded load (consistent hashing with bounded loads, Mirrokni et al.): a worker may take an affine request
while its load is below ``ceil(load_factor * (total load + 1) / workers)``, so one hot session or persona
cannot pile every request on one worker while the others idle; past the bound its requests spill over, and
the worker they spill to pins the persona too.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.streams import Beat

Policy = Literal["affinity", "random"]
REASONS = ("session", "persona", "load", "failover", "random")
DEFAULT_LOAD_FACTOR = 1.25


@dataclass
class Router:
    policy: Policy = "affinity"
    load_factor: float = DEFAULT_LOAD_FACTOR
    rng: random.Random = field(default_factory=random.Random)
    decisions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def choose(self, workers: Sequence[Beat], *, pending: Mapping[str, int] | None = None,
               pinning: Mapping[str, Collection[str]] | None = None, session_home: str | None = None,
               pin: str | None = None, failover: bool = False) -> Beat | None:
        """The worker for a request, counted under its reason; None when no worker takes requests.

        ``session_home``: where the session's last turn left its KV (a ``Beat.home``, or a worker id as
        records written before homes were);
        ``pending``: requests this gateway dispatched per worker that its last beat may not count yet;
        ``pinning``: pin keys this gateway asked a worker to pin that its last beat may not list yet.
        """
        live = [w for w in workers if not w.draining]
        if not live:
            return None
        pending = pending or {}

        def load(w: Beat) -> int:
            return max(w.load, pending.get(w.worker, 0))

        def rank(w: Beat) -> tuple[int, int, str]:
            return load(w), -w.free_blocks, w.worker

        if self.policy == "random":
            return self._count("failover" if failover else "random", self.rng.choice(live))
        bound = math.ceil(self.load_factor * (sum(load(w) for w in live) + 1) / len(live))
        if not failover:
            if session_home is not None:
                homes = [w for w in live if session_home in (w.home, w.worker) and load(w) < bound]
                if homes:
                    return self._count("session", min(homes, key=rank))
            if pin is not None:
                pinned = [w for w in live if (pin in w.pins or pin in (pinning or {}).get(w.worker, ()))
                          and load(w) < bound]
                if pinned:
                    return self._count("persona", min(pinned, key=rank))
        return self._count("failover" if failover else "load", min(live, key=rank))

    def _count(self, reason: str, worker: Beat) -> Beat:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        return worker
