"""Router: session, persona and load placement under the load bound; draining workers skipped; random."""

from __future__ import annotations

import random

from chatsvc.router import Router
from engine.protocol import EngineStats
from engine.streams import Beat


def beat(worker: str, running: int = 0, waiting: int = 0, free: int = 100, pins: tuple[str, ...] = (),
         draining: bool = False, kv_home: str = "") -> Beat:
    return Beat(worker=worker, pid=1, host="h", model_name="m", max_model_len=512, block_size=16, time=0.0,
                draining=draining, pins=list(pins),
                stats=EngineStats(requests_running=running, requests_waiting=waiting, kv_blocks_free=free),
                kv_home=kv_home)


def test_session_goes_back_to_its_worker_while_it_is_within_the_bound() -> None:
    router = Router()
    workers = [beat("a", running=1), beat("b")]
    assert router.choose(workers, session_home="a").worker == "a"  # type: ignore[union-attr]
    assert router.decisions["session"] == 1
    # a carries 3 of 3: the bound ceil(1.25 * 4 / 2) = 3 is reached, so the turn spills to the least loaded.
    assert router.choose([beat("a", running=3), beat("b")], session_home="a").worker == "b"  # type: ignore[union-attr]
    assert router.decisions["load"] == 1


def test_a_session_follows_its_kv_home_to_the_worker_restarted_on_it() -> None:
    """A worker with a disk tier is known by its directory's name: the process that served the session
    restarted as a new worker id on the same directory still gets the session (its blocks are on disk there),
    though another worker has more room."""
    router = Router()
    before = beat("a-1", kv_home="kv-a")
    assert before.home == "kv-a" and beat("b").home == "b"
    restarted = [beat("b", free=500), beat("a-2", free=10, kv_home="kv-a")]
    assert router.choose(restarted, session_home=before.home).worker == "a-2"  # type: ignore[union-attr]
    assert router.choose(restarted, session_home="b").worker == "b"  # type: ignore[union-attr]
    assert router.decisions["session"] == 2
    # A record naming the old worker id (written before homes were) still finds that worker while it lives.
    assert router.choose([beat("b", free=500), before], session_home="a-1").worker == "a-1"  # type: ignore[union-attr]


def test_a_gone_or_draining_session_worker_falls_back_to_persona_then_load() -> None:
    router = Router()
    workers = [beat("a", draining=True, pins=("persona:x",)), beat("b", running=2), beat("c", pins=("persona:x",))]
    assert router.choose(workers, session_home="a", pin="persona:x").worker == "c"  # type: ignore[union-attr]
    assert router.choose(workers, session_home="gone").worker == "c"  # type: ignore[union-attr]
    assert (router.decisions["persona"], router.decisions["load"]) == (1, 1)


def test_persona_prefers_the_least_loaded_worker_that_pins_it_and_counts_pins_in_flight() -> None:
    router = Router()
    workers = [beat("a", running=1, pins=("p",)), beat("b", pins=("p",)), beat("c")]
    assert router.choose(workers, pin="p").worker == "b"  # type: ignore[union-attr]
    # A pin this gateway asked of c counts before c's beat lists it.
    workers = [beat("a", running=2, pins=("p",)), beat("c")]
    assert router.choose(workers, pin="p", pinning={"c": {"p"}}).worker == "c"  # type: ignore[union-attr]
    assert router.decisions["persona"] == 2


def test_load_ranks_by_queue_then_free_blocks_and_pending_dispatches_count() -> None:
    router = Router()
    assert router.choose([beat("a", free=10), beat("b", free=50)]).worker == "b"  # type: ignore[union-attr]
    # This gateway's own dispatches the beats do not show yet make b the busier one.
    assert router.choose([beat("a", free=10), beat("b", free=50)], pending={"b": 2}).worker == "a"  # type: ignore[union-attr]


def test_failover_ignores_affinity_and_no_live_worker_gives_none() -> None:
    router = Router()
    workers = [beat("a", running=5, pins=("p",)), beat("b")]
    assert router.choose(workers, session_home="a", pin="p", failover=True).worker == "b"  # type: ignore[union-attr]
    assert router.decisions["failover"] == 1
    assert router.choose([beat("a", draining=True)]) is None
    assert router.choose([]) is None


def test_random_policy_ignores_affinity() -> None:
    router = Router(policy="random", rng=random.Random(0))
    workers = [beat("a", pins=("p",)), beat("b")]
    chosen = {router.choose(workers, session_home="a", pin="p").worker for _ in range(50)}  # type: ignore[union-attr]
    assert chosen == {"a", "b"} and router.decisions["random"] == 50
