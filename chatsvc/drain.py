"""Drain on SIGTERM: a gateway being replaced (a rolling restart) finishes what it started before it exits.

The first SIGTERM sets the gateway draining: it keeps listening, answers every new turn or generation with
503 and ``Retry-After`` (another instance, or this one's successor, takes it), reports ``draining`` on
``/health`` and 503 on ``/ready`` (so a load balancer stops sending it traffic), and lets the turns and
requests in flight finish. Once none is left, or ``--drain-timeout`` has passed, uvicorn's own shutdown
runs and the process exits 0. At the timeout, behind engine workers (``--engine redis``, whose requests go
on without this gateway) and with ``--drain-handoff`` (the default), the turns still running are handed to
the other gateways first (``TurnRegistry.hand_off``: the take-over of a dead gateway's turns, started at
once): their clients resume them there and each reply is stored once, whole. Otherwise (an engine in this
process, no other gateway alive, or ``--no-drain-handoff``) they are cut and stored once as ``interrupted``
(``TurnRegistry.shutdown``). A second SIGTERM, or SIGINT, skips the rest of the drain.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from chatsvc.context import Gateway

log = logging.getLogger("chatsvc.drain")


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first SIGTERM drains ``gateway`` for up to ``drain_timeout_s`` seconds."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.drain_deadline is not None or self.drain_timeout_s <= 0:
            super().handle_exit(sig, frame)
            return
        # Re-raised once uvicorn has shut down, as for any signal it handles (chatsvc.cli then exits 0).
        self._captured_signals.append(sig)
        self.drain_deadline = time.monotonic() + self.drain_timeout_s
        self.gateway.draining = True
        log.warning("SIGTERM: draining (new turns get 503) for up to %.0f s; %d turns in flight",
                    self.drain_timeout_s, len(self.gateway.turns.active))

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            if self.gateway.idle:
                log.warning("drained: nothing in flight; shutting down")
                self.should_exit = True
            elif time.monotonic() >= self.drain_deadline:
                if self.gateway.settings.drain_handoff:
                    await self.gateway.turns.hand_off()
                if self.gateway.turns.active:
                    log.warning("drain timeout: %d turns still running are stored as interrupted",
                                len(self.gateway.turns.active))
                self.should_exit = True
        return await super().on_tick(counter)
