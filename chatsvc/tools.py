"""Tool calling at the gateway: tools and past calls in the prompt, and the reply's calls parsed as it streams.

The prompt. A chat template that takes ``tools`` (it names the variable) gets the tools, past calls and
``tool`` results as OpenAI's messages carry them (a call's arguments as an object, as Hugging Face templates
expect). A template without tool syntax (SmolLM2's) gets them as text in the Hermes/Qwen format the grammar
makes the model answer in (``engine.grammar``):

  * the tools, listed after the system prompt (``fallback_tools_text``);
  * an assistant message's calls, as ``<tool_call>`` blocks after its text;
  * ``tool`` results, each in a ``<tool_response>`` block, consecutive ones together in one ``user`` message
    (the roles such a template knows).

The reply. Under a ``tool_calls`` / ``tool_calls_auto`` grammar a reply is text or ``<tool_call>`` blocks
whose JSON has a fixed layout (``{"name": "...", "arguments": {...}}`` on one line), so ``ToolCallParser``
splits it as it streams: text passes through, each call gives its name once and then its arguments in
fragments, and no markup reaches the content.
"""

from __future__ import annotations

import functools
import json
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta

from engine.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
# What the grammar makes the model write before a call's name and between its name and its arguments.
_CALL_HEAD = TOOL_CALL_OPEN + '\n{"name": "'
_NAME_TAIL = '", "arguments": '
# What ends a call: the call object's brace, then the closing tag on its own line (compact JSON holds no
# newline, so the first one ends the arguments).
_CALL_TAIL = "}\n" + TOOL_CALL_CLOSE


def new_call_id() -> str:
    """An id in OpenAI's shape (``call_`` and 24 characters)."""
    return "call_" + secrets.token_hex(12)


@functools.lru_cache(maxsize=8)
def _template_takes_tools(template: str) -> bool:
    try:
        parsed = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def template_takes_tools(hf_tokenizer: Any) -> bool:
    """The tokenizer's chat template renders a ``tools`` argument."""
    template = getattr(hf_tokenizer, "chat_template", None)
    return isinstance(template, str) and _template_takes_tools(template)


def fallback_tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools and the call format, for a template without tool syntax (Qwen2.5's wording)."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
            f'{TOOL_CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{TOOL_CALL_CLOSE}')


def call_block(call: Mapping[str, Any]) -> str:
    """One OpenAI tool call (``{"id", "type", "function": {"name", "arguments"}}``) as the model writes it."""
    fn = call["function"]
    return (f"{TOOL_CALL_OPEN}\n"
            f'{json.dumps({"name": fn["name"], "arguments": _arguments(fn["arguments"])}, ensure_ascii=False)}'
            f"\n{TOOL_CALL_CLOSE}")


def _arguments(arguments: Any) -> Any:
    """A call's arguments as an object where its JSON text is one (templates and blocks hold objects)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def prompt_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                    native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for ``apply_chat_template``: OpenAI's messages (``tool_calls``, ``tool`` messages)
    and the tools to show the model (None: none), for a template that takes tools (``native``) or not."""
    if native:
        out = [{**m, "tool_calls": [{**c, "function": {**c["function"],
                                                        "arguments": _arguments(c["function"]["arguments"])}}
                                    for c in m["tool_calls"]]} if m.get("tool_calls") else dict(m)
               for m in messages]
        return out, [dict(t) for t in tools] if tools else None
    rendered: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{m.get('content') or ''}\n{TOOL_RESPONSE_CLOSE}"
            if rendered and rendered[-1].get("from_tool"):
                rendered[-1]["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "from_tool": True})
        elif m.get("tool_calls"):
            parts = ([m["content"]] if m.get("content") else []) + [call_block(c) for c in m["tool_calls"]]
            rendered.append({"role": m["role"], "content": "\n".join(parts)})
        else:
            rendered.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        listing = fallback_tools_text(tools)
        if rendered and rendered[0]["role"] == "system":
            rendered[0]["content"] = f"{rendered[0]['content']}\n\n{listing}"
        else:
            rendered.insert(0, {"role": "system", "content": listing})
    return [{"role": m["role"], "content": m["content"]} for m in rendered], None


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True
                    ) -> list[int]:
    """The prompt of a conversation in OpenAI's messages, with ``tools`` shown to the model (None: none),
    through the tokenizer's template (its tool syntax where it has one, the fallback text otherwise);
    without ``add_generation_prompt``, the history the next message's prompt starts with."""
    rendered, shown = prompt_messages(messages, tools, template_takes_tools(getattr(tokenizer, "hf", None)))
    extra = {"tools": shown} if shown else {}  # a template without tool syntax is called as before
    return list(tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt, **extra))


def prompt_chars(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None) -> int:
    """The characters the prompt holds at least: what the gateway bounds before it tokenizes."""
    text = sum(len(str(m.get("content") or "")) for m in messages)
    calls = sum(len(c["function"]["arguments"]) for m in messages for c in m.get("tool_calls") or ())
    return text + calls + (len(json.dumps(list(tools))) if tools else 0)


def unknown_tool_results(messages: Sequence[Mapping[str, Any]]) -> int | None:
    """The index of the first ``tool`` message whose ``tool_call_id`` no earlier assistant call has."""
    called: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.get("tool_calls") or ():
            called.add(str(call.get("id")))
        if m.get("role") == "tool" and m.get("tool_call_id") not in called:
            return i
    return None


@dataclass
class ToolCallDelta:
    """A piece of one call, as OpenAI streams it: ``id`` and ``name`` on its first piece only."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        """``delta.tool_calls[i]`` of a chunk."""
        fn: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            fn = {"name": self.name, "arguments": self.arguments}
        out["function"] = fn
        return out


class ToolCallParser:
    """Splits a reply written under a tool grammar into content and call pieces, fed as it streams."""

    def __init__(self) -> None:
        self._pending = ""
        self._mode = ""  # "" (undecided: the text so far may begin a call), "text", "calls"
        self._state = "head"  # in calls: "head" (before a name), "name", "arguments"
        self.calls: list[dict[str, Any]] = []  # OpenAI's tool_calls, arguments growing as they arrive

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, call pieces) that ``text`` completes."""
        self._pending += text
        if not self._mode:
            if TOOL_CALL_OPEN.startswith(self._pending):
                return "", []
            self._mode = "calls" if self._pending.startswith(TOOL_CALL_OPEN) else "text"
        deltas = self._parse_calls() if self._mode == "calls" else []
        if self._mode == "text":
            out, self._pending = self._pending, ""
            return out, deltas
        return "", deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left once the reply ended: text held back in case it began a call, or the unfinished
        rest of a call's arguments (a reply cut at ``max_tokens``)."""
        rest, self._pending = self._pending, ""
        if self._mode != "calls" or not self.calls:
            return rest, []
        if self._state == "arguments" and rest:
            return "", [self._arguments(rest)]
        return "", []

    def _parse_calls(self) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while True:
            if self._state == "head":
                self._pending = self._pending.lstrip("\n")  # between parallel calls
                if not self._pending.startswith(_CALL_HEAD):
                    if not self.calls and not _CALL_HEAD.startswith(self._pending):
                        self._mode = "text"  # not a call after all (only without a grammar): text it is
                    return out
                self._pending = self._pending[len(_CALL_HEAD):]
                self._state = "name"
            if self._state == "name":
                end = self._pending.find(_NAME_TAIL)
                if end < 0:
                    return out
                name = self._pending[:end]
                self._pending = self._pending[end + len(_NAME_TAIL):]
                call_id = new_call_id()
                self.calls.append({"id": call_id, "type": "function",
                                   "function": {"name": name, "arguments": ""}})
                out.append(ToolCallDelta(len(self.calls) - 1, "", call_id, name))
                self._state = "arguments"
            end = self._pending.find(_CALL_TAIL)
            if end < 0:
                # Everything but what may be the start of the call's end.
                keep = len(_CALL_TAIL) - 1
                if len(self._pending) > keep:
                    out.append(self._arguments(self._pending[:-keep]))
                    self._pending = self._pending[-keep:]
                return out
            if end:
                out.append(self._arguments(self._pending[:end]))
            self._pending = self._pending[end + len(_CALL_TAIL):]
            self._state = "head"

    def _arguments(self, fragment: str) -> ToolCallDelta:
        self.calls[-1]["function"]["arguments"] += fragment
        return ToolCallDelta(len(self.calls) - 1, fragment)


def parse_reply(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole reply: (content, or None where it is calls; the calls). Text that only looks like the start
    of a call (a reply written without a tool grammar) stays text."""
    parser = ToolCallParser()
    parser.feed(text)
    parser.finish()
    return (None, parser.calls) if parser.called else (text, [])
