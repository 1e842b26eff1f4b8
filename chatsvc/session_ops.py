"""Session operations shared by every transport (HTTP routes in ``sessions``, WebSocket in ``ws``).

A transport parses its own framing, then calls these: create, load (or 404), view, send a message,
resume a reply, cancel. A reply is read through a :class:`ReplyReader`, which holds the reader's
place on a running turn and gives it back exactly once, however the transport stops reading.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from chatsvc.context import Gateway
from chatsvc.errors import APIError
from chatsvc.personas import DEFAULT_PERSONA
from chatsvc.schemas import (
    ResponseFormat,
    SessionCreate,
    SessionMessage,
    SessionUpdate,
    check_event_id,
    check_session_id,
    session_not_found,
)
from chatsvc.store import SessionMeta
from chatsvc.store.sessions import new_session_id
from chatsvc.turns import ActiveTurn, parse_event_id


async def load_session(gw: Gateway, sid: str, owner: str) -> SessionMeta:
    check_session_id(sid)
    meta = await gw.store.get_session(sid, owner)
    if meta is None:
        raise session_not_found(sid)
    return meta


def warm_session(gw: Gateway, meta: SessionMeta) -> None:
    """A client opened the session: its next message is likely, so the engine may bring the history's KV
    blocks up its tiers meanwhile (chatsvc.warm). Not while a reply is generated: those blocks are in use."""
    if meta.id not in gw.turns.active:
        gw.turns.warmer.warm(meta)


async def create_session(gw: Gateway, owner: str, persona: str | None, title: str | None = None,
                         settings: SessionCreate | None = None) -> SessionMeta:
    """``settings``: a create request's other fields (its ``response_format``, compiled here: a 400 before
    anything is stored)."""
    name = persona or DEFAULT_PERSONA
    found = await gw.personas.get(owner, name)
    if found is None:
        raise APIError(404, f"persona {name!r} not found", code="persona_not_found", param="persona")
    body = found[1]
    response_format = ""
    if settings is not None:
        await gw.grammars.check(gw.engine.tokenizer, settings.grammar())
        response_format = settings.stored_response_format()
    await gw.quotas.new_session(owner)  # after the checks: a refused request leaves nothing in Redis
    sid = new_session_id()
    await gw.quotas.live_session(owner, sid)
    try:
        # The prompt is copied so later edits of the persona do not rewrite existing conversations.
        return await gw.store.create_session(owner, name, body["system_prompt"], title or "", sid=sid,
                                             response_format=response_format)
    except BaseException:
        await gw.quotas.session_gone(owner, sid)
        raise


async def update_session(gw: Gateway, meta: SessionMeta, req: SessionUpdate) -> SessionMeta:
    """Changes the settings ``req`` sends (a bad schema: 400, nothing changed); the next turn uses them."""
    fields: dict[str, str] = {}
    if "title" in req.model_fields_set:
        fields["title"] = req.title or ""
    if "response_format" in req.model_fields_set:
        await gw.grammars.check(gw.engine.tokenizer, req.grammar())
        fields["response_format"] = req.stored_response_format()
    updated = await gw.store.update_session(meta.id, meta.owner, **fields) if fields else meta
    if updated is None:
        raise session_not_found(meta.id)
    return updated


def page_limit(gw: Gateway, value: object) -> int:
    """A client's ``limit`` of messages (None: the default page); 400 unless 1..max_history_page."""
    if value is None:
        return gw.settings.history_page
    return _index(value, "limit", 1, gw.settings.max_history_page)


def _index(value: object, name: str, low: int, high: int | None = None) -> int:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not text.isascii() or not text.isdigit() or len(text) > 19:
        raise APIError(400, f"{name} must be a whole number", code="invalid_value", param=name)
    n = int(text)
    if n < low or high is not None and n > high:
        raise APIError(400, f"{name} must be between {low} and {high}" if high is not None
                       else f"{name} must be at least {low}", code="invalid_value", param=name)
    return n


async def history_page(gw: Gateway, meta: SessionMeta, limit: object = None,
                       before: object = None) -> dict[str, Any]:
    """The session's messages before the absolute index ``before`` (None: the newest), ``limit`` of them;
    ``first_index`` and ``has_more`` say where to ask next."""
    page = await gw.store.message_page(meta.id, page_limit(gw, limit),
                                       None if before is None else _index(before, "before", 0))
    return {"id": meta.id, **page.public()}


async def session_view(gw: Gateway, meta: SessionMeta, limit: object = None) -> dict[str, Any]:
    """The session with its newest messages (``limit``, or the default page)."""
    size = page_limit(gw, limit)
    # Busy here, or on another live instance (a dead instance's lock does not count).
    busy = meta.id in gw.turns.active or await gw.store.is_busy(meta.id)
    page = await gw.store.message_page(meta.id, size)
    return {**meta.public(), "busy": busy, **page.public()}


@dataclass(eq=False)
class ReplyReader:
    """One reader of one session reply: its events after ``after``, until the done/error event."""

    gw: Gateway
    session_id: str
    turn: int
    after: str
    _at: ActiveTurn | None  # the running turn this reader holds, if the reply is still being generated here
    _remote: str | None = None  # its place on a turn another gateway generates

    def events(self) -> AsyncIterator[tuple[str, dict[str, Any], str]]:
        """(event id, event, its stored JSON). The transport calls :meth:`release` once it stops reading
        (a generator left by an exception or a closed outer generator is not closed in time by itself)."""
        return self.gw.turns.follow_json(self.session_id, self.turn, self.after)

    def release(self, abort_now: bool = False) -> None:
        """Give the turn back (idempotent): the last reader to leave starts its abort grace, or aborts it."""
        at, self._at = self._at, None
        if at is not None:
            self.gw.turns.detach(at, abort_now=abort_now)
        remote, self._remote = self._remote, None
        if remote is not None:
            self.gw.turns.detach_remote(remote, abort_now=abort_now)


async def send_message(gw: Gateway, meta: SessionMeta, req: SessionMessage) -> ReplyReader:
    """Store the user's message and start the reply; the caller reads it from the start."""
    gw.refuse_if_draining()
    # The session's response_format, unless the message has its own or calls tools.
    if req.response_format is None and meta.response_format and not req.calls_tools():
        req = req.model_copy(update={"response_format": ResponseFormat.model_validate_json(meta.response_format)})
    # A bad schema stores no message.
    await gw.grammars.check(gw.engine.tokenizer, req.checked_grammar(), req.grammar_param())
    lease = await gw.quotas.reserve_generation(meta.owner)  # the turn gives it back when it ends
    try:
        await gw.quotas.session_used(meta.owner, meta.id)
    except BaseException:
        await lease.release()
        raise
    with gw.quotas.admitting(meta.owner):
        at = await gw.turns.start(meta, req, lease)
    return ReplyReader(gw, meta.id, at.turn, "0", at)


async def resume(gw: Gateway, meta: SessionMeta, last_event_id: str | None) -> ReplyReader:
    """(Re)attach to a reply after the last event id seen (``"turn:stream-id"``; none: the latest turn)."""
    check_event_id(last_event_id)
    turn, after = parse_event_id(last_event_id)
    turn = meta.turns if turn is None else turn
    gw.quotas.check_readers(gw.turns.active.get(meta.id))
    at = gw.turns.attach(meta.id, turn)
    remote = None if at is not None else await gw.turns.attach_remote(meta.id, turn)
    if at is None and remote is None and not await gw.store.stream_exists(meta.id, turn):
        raise APIError(404, "no reply to resume (finished and expired, or never started)", code="stream_not_found")
    return ReplyReader(gw, meta.id, turn, after, at, remote)
