"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions (stateless)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatsvc.context import Gateway, gateway, parse, read_json
from chatsvc.errors import APIError
from chatsvc.generation import Generation
from chatsvc.offload import Raw, TokenTexts, dumps_in_pieces
from chatsvc.quotas import Lease
from chatsvc.schemas import ChatCompletionRequest, CompletionRequest, resolve_max_tokens, usage
from chatsvc.tools import ToolCallParser, parse_reply
from chatsvc.wire import ChunkTemplate, EventStream, sse_event
from engine.protocol import RequestDelta, StreamOverflowError

R = TypeVar("R", ChatCompletionRequest, CompletionRequest)


async def list_models(request: Request) -> JSONResponse:
    gw = gateway(request)
    gw.auth.from_http(request.headers, request.query_params)
    data = [{"id": gw.engine.model_name, "object": "model", "created": 0, "owned_by": "chatsvc",
             "max_model_len": gw.engine.max_model_len}]
    return JSONResponse({"object": "list", "data": data})


class _Tokens:
    """Token strings for logprobs, each token id decoded once per request."""

    def __init__(self, tokenizer: Any) -> None:
        self.text = TokenTexts(tokenizer)

    def chat(self, token_ids: list[int], lps: list[dict[int, float]] | None,
             top_n: int) -> Iterator[dict[str, Any]]:
        """OpenAI's chat logprobs, an entry per token (a whole reply encodes each as soon as it is built)."""
        for tid, d in zip(token_ids, lps or [], strict=False):
            s = self.text(tid)
            tops = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
            yield {"token": s, "logprob": float(d.get(tid, -9999.0)), "bytes": list(s.encode()),
                   "top_logprobs": [{"token": self.text(t), "logprob": float(lp),
                                     "bytes": list(self.text(t).encode())} for t, lp in tops]}

    def completion(self, token_ids: list[int], lps: list[dict[int, float]] | None, top_n: int,
                   offset: int, encoded: bool = False) -> dict[str, Any]:
        """OpenAI's completion logprobs; ``encoded``: each top_logprobs dict already encoded (see chat)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, d in zip(token_ids, lps or [], strict=False):
            s = self.text(tid)
            tokens.append(s)
            token_lps.append(float(d.get(tid, -9999.0)))
            top = {self.text(t): float(lp) for t, lp in sorted(d.items(), key=lambda kv: -kv[1])[:top_n]}
            tops.append(Raw(json.dumps(top)) if encoded else top)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _finish(gen: Generation, lease: Lease) -> None:
    """A streamed response's background task: abort the request (if still running) and give its quota
    place back (also for a client gone before the stream began, or a send that timed out)."""
    try:
        await gen.close()
    finally:
        await lease.release()


@dataclass
class _Collected:
    texts: dict[int, list[str]] = field(default_factory=dict)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    lps: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    reasons: dict[int, str | None] = field(default_factory=dict)
    last: dict[int, Any] = field(default_factory=dict)


async def _collect(request: Request, gen: Generation, prefix: str = "") -> _Collected:
    """All deltas of a non-streaming request; a client that hangs up aborts the generation."""
    got = _Collected()

    async def run() -> None:
        async for d in gen.deltas():
            got.texts.setdefault(d.index, [prefix]).append(d.text)
            got.tokens.setdefault(d.index, []).extend(d.token_ids)
            got.lps.setdefault(d.index, []).extend(d.logprobs or [])
            got.last[d.index] = d
            if d.finished:
                got.reasons[d.index] = d.finish_reason

    task = asyncio.create_task(run())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await request.is_disconnected():
                raise APIError(499, "client closed the request", code="client_disconnected")
        await task
        return got
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await gen.close()


def _usage(last: dict[int, Any], prompt_tokens: int) -> dict[str, Any]:
    completion = sum(d.completion_tokens for d in last.values())
    cached = max((d.cached_tokens for d in last.values()), default=0)
    prompt = next((d.prompt_tokens for d in last.values()), prompt_tokens)
    return usage(prompt, completion, cached)


async def _parse_request(request: Request, schema: type[R]) -> tuple[Gateway, str, R, str]:
    """(gateway, caller, request, model name), all checked that can be before the prompt is tokenized."""
    gw = gateway(request)
    owner = gw.auth.from_http(request.headers, request.query_params)
    req = parse(schema, await read_json(request, gw.settings.max_body_bytes))
    model = gw.check_model(req.model)
    if req.n > gw.settings.max_n:
        raise APIError(400, f"n must be <= {gw.settings.max_n}", code="invalid_value", param="n")
    if req.best_of is not None and req.best_of > gw.settings.max_n:  # beams cost the engine what samples do
        raise APIError(400, f"best_of must be <= {gw.settings.max_n}", code="invalid_value", param="best_of")
    return gw, owner, req, model


# A streamed delta as its chunk's JSON: (the chunk template, delta, first of its choice?, finish reason).
ChunkOf = Callable[[ChunkTemplate, RequestDelta, bool, str | None], str]


async def _generate(request: Request, gw: Gateway, owner: str, req: ChatCompletionRequest | CompletionRequest,
                    model: str, prompt_ids: list[int], max_tokens: int, logprobs: int | None, chunk: ChunkOf,
                    choice: Callable[[int, _Collected], dict[str, Any]], echo: str = "") -> Response:
    """Admit the generation under the caller's concurrency and waiting-queue quotas (429 past them), then
    stream its chunks or answer with the whole reply."""
    # A non-streamed reply with logprobs is built and sent whole: cap its size up front.
    entries = req.n * max_tokens * (1 + (logprobs or 0))
    if not req.stream and logprobs is not None and entries > gw.settings.max_logprob_entries:
        raise APIError(400, f"n x max_tokens x (1 + top logprobs) = {entries} exceeds "
                       f"{gw.settings.max_logprob_entries} for a non-streamed request; stream it or ask for "
                       "less", code="invalid_value", param="max_tokens")
    chat = isinstance(req, ChatCompletionRequest)
    rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
    obj = "chat.completion" if chat else "text_completion"
    gw.refuse_if_draining()
    # A 400 before the engine sees it.
    await gw.grammars.check(gw.engine.tokenizer, req.checked_grammar(), req.grammar_param())
    params = gw.isolation.apply(owner, req.sampling_params(max_tokens, req.n, logprobs), prompt_ids)
    gen = Generation(gw.engine, gw.metrics, rid, params, prompt_ids, gw.settings.retry_after_s)
    # Each sequence (n samples, best_of candidates, beams) costs the engine a slot.
    lease = await gw.quotas.reserve_generation(owner, max(req.n, req.best_of or 1))
    try:
        with gw.quotas.admitting(owner):
            await gw.rates.charge(owner, len(prompt_ids), "prompt")  # its prefill, before the engine sees it
            await gen.start()
    except BaseException:
        await lease.release()
        raise
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        template = ChunkTemplate(rid, obj + ".chunk" if chat else obj, created, model, include_usage)
        # The background close also aborts a request whose client left before the stream began.
        return EventStream(_stream(gw, gen, lease, template, chunk), ping=10,
                           send_timeout=gw.settings.sse_send_timeout_s,
                           background=BackgroundTask(_finish, gen, lease))
    try:
        got = await _collect(request, gen, echo)
    finally:
        await lease.release()

    def build() -> dict[str, Any]:
        return {"id": rid, "object": obj, "created": created, "model": model,
                "choices": [choice(i, got) for i in sorted(got.texts)],
                "usage": _usage(got.last, len(prompt_ids))}

    # Built and encoded on a worker thread, in small pieces.
    return Response(await gw.offload.run(lambda: dumps_in_pieces(build())), media_type="application/json")


async def chat_completions(request: Request) -> Response:
    gw, owner, req, model = await _parse_request(request, ChatCompletionRequest)
    prompt_ids = await gw.offload.chat_ids([m.openai() for m in req.messages],
                                           req.tool_dicts() if req.calls_tools() else None)
    max_tokens = resolve_max_tokens(req.requested_max_tokens(), len(prompt_ids), gw.engine.max_model_len,
                                    None)
    top = req.top_logprobs or 0
    toks = _Tokens(gw.engine.tokenizer)
    # Under a tool grammar the reply's text is split into content and calls (chatsvc.tools), per choice.
    parsers: dict[int, ToolCallParser] | None = {} if req.calls_tools() else None

    def logprobs(token_ids: list[int], lps: list[dict[int, float]] | None) -> dict[str, Any]:
        return {"content": list(toks.chat(token_ids, lps, top))}

    def tool_chunk(template: ChunkTemplate, d: RequestDelta, first: bool, reason: str | None) -> str:
        assert parsers is not None
        parser = parsers.setdefault(d.index, ToolCallParser())
        content, calls = parser.feed(d.text)
        if d.finished:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
            reason = "tool_calls" if reason == "stop" and parser.called else reason
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if content or (first and not calls):
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.openai() for c in calls]
        return template.encode([{"index": d.index, "delta": delta,
                                 "logprobs": logprobs(d.token_ids, d.logprobs) if req.logprobs else None,
                                 "finish_reason": reason}])

    def chunk(template: ChunkTemplate, d: RequestDelta, first: bool, reason: str | None) -> str:
        if parsers is not None:
            return tool_chunk(template, d, first, reason)
        if not req.logprobs:
            return template.chat(d.index, d.text, first, reason)
        delta: dict[str, Any] = {"role": "assistant", "content": d.text} if first else {"content": d.text}
        return template.encode([{"index": d.index, "delta": delta, "logprobs": logprobs(d.token_ids, d.logprobs),
                                 "finish_reason": reason}])

    def choice(i: int, got: _Collected) -> dict[str, Any]:
        text: str | None = "".join(got.texts[i])
        reason = got.reasons.get(i)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if parsers is not None:
            message["content"], calls = parse_reply(text or "")
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        return {"index": i, "message": message,
                "logprobs": {"content": [Raw(json.dumps(entry))
                                         for entry in toks.chat(got.tokens[i], got.lps[i], top)]}
                if req.logprobs else None,
                "finish_reason": reason}

    return await _generate(request, gw, owner, req, model, prompt_ids, max_tokens,
                           top if req.logprobs else None, chunk, choice)


async def completions(request: Request) -> Response:
    gw, owner, req, model = await _parse_request(request, CompletionRequest)
    tok = gw.engine.tokenizer
    if isinstance(req.prompt, str) or isinstance(req.prompt[0], str):
        prompt_text = req.prompt if isinstance(req.prompt, str) else str(req.prompt[0])
        prompt_ids = await gw.offload.encode(prompt_text)
    else:
        # Refused by length before any work; checked and decoded off the event loop (a long list takes
        # the tokenizer a while).
        if len(req.prompt) >= gw.engine.max_model_len:
            raise APIError(400, f"the prompt is {len(req.prompt)} token ids; the context is "
                           f"{gw.engine.max_model_len}", code="context_length_exceeded", param="prompt")
        prompt_ids = [int(t) for t in req.prompt]
        if any(t < 0 or t >= tok.vocab_size for t in prompt_ids):
            raise APIError(400, "prompt token id out of range", code="invalid_value", param="prompt")
        prompt_text = await gw.offload.run(lambda: tok.decode(prompt_ids, skip_special_tokens=False))
    if not prompt_ids:
        raise APIError(400, "prompt must contain at least one token", code="invalid_value", param="prompt")
    max_tokens = resolve_max_tokens(req.max_tokens, len(prompt_ids), gw.engine.max_model_len, 16)
    echo = prompt_text if req.echo else ""
    toks = _Tokens(tok)
    offsets: dict[int, int] = {}  # per choice: where its next delta starts in its text

    def chunk(template: ChunkTemplate, d: RequestDelta, first: bool, reason: str | None) -> str:
        text = echo + d.text if first else d.text
        if req.logprobs is None:
            return template.completion(d.index, text, reason)
        off = offsets.get(d.index, len(echo))
        offsets[d.index] = off + len(d.text)
        return template.encode([{"index": d.index, "text": text,
                                 "logprobs": toks.completion(d.token_ids, d.logprobs, req.logprobs, off),
                                 "finish_reason": reason}])

    def choice(i: int, got: _Collected) -> dict[str, Any]:
        return {"index": i, "text": "".join(got.texts[i]), "finish_reason": got.reasons.get(i),
                "logprobs": toks.completion(got.tokens[i], got.lps[i], req.logprobs or 0, len(echo), True)
                if req.logprobs is not None else None}

    return await _generate(request, gw, owner, req, model, prompt_ids, max_tokens, req.logprobs, chunk,
                           choice, echo)


async def _stream(gw: Gateway, gen: Generation, lease: Lease, template: ChunkTemplate,
                  chunk: ChunkOf) -> AsyncIterator[bytes]:
    """A chunk per delta, the usage chunk if asked for, then ``[DONE]``. A request failing after the response
    began (its engine process died, a step failed it) ends with an OpenAI-shaped error event and ``[DONE]``
    rather than a cut connection (as vLLM does: clients that wait for [DONE] end cleanly and see the error
    before it)."""
    last: dict[int, RequestDelta] = {}
    gw.metrics.open_sse.inc()
    try:
        async for d in gen.deltas():
            first = d.index not in last
            last[d.index] = d
            yield sse_event(chunk(template, d, first, d.finish_reason if d.finished else None))
        if template.include_usage:
            yield sse_event(template.encode([], _usage(last, 0)))
    except Exception as exc:  # noqa: BLE001 - whatever it was, the client is told the stream failed
        code = StreamOverflowError.code if isinstance(exc, StreamOverflowError) else "engine_failed"
        message = str(exc) or type(exc).__name__
        yield sse_event(json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                              "code": code}}))
    finally:  # also when the client left: the request is aborted and its quota given back now, not at GC
        gw.metrics.open_sse.dec()
        await lease.release()
        await gen.close()
    yield sse_event("[DONE]")


routes = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
