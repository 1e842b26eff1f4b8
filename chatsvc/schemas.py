"""Pydantic request schemas (OpenAI-compatible plus vLLM's extensions) and response builders."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chatsvc.errors import APIError
from engine.grammar import GrammarSpec, tool_call_spec
from engine.request import SamplingParams


class _Lenient(BaseModel):
    # Unknown fields are ignored, like OpenAI does for fields it does not know.
    model_config = ConfigDict(extra="ignore")


INT32_MAX = 2**31 - 1
MAX_STOP_CHARS = 256  # the detokenizer holds back up to this much text per token while it might match

# Fields that change behaviour elsewhere; silently ignoring them would return something the caller did not
# ask for. Each maps to the test that says a value is the default (so it may be sent and is harmless).
_UNSUPPORTED: dict[str, Any] = {
    "logit_bias": lambda v, d: not v,
    "tools": lambda v, d: not v,
    "tool_choice": lambda v, d: v in (None, "none"),
    "functions": lambda v, d: not v,
    "function_call": lambda v, d: v in (None, "none"),
    "best_of": lambda v, d: v is None or v == d.get("n", 1) or bool(d.get("use_beam_search")),
    "suffix": lambda v, d: not v,
    "guided_json": lambda v, d: v is None,
    "guided_regex": lambda v, d: v is None,
    "guided_choice": lambda v, d: v is None,
    "guided_grammar": lambda v, d: v is None,
}

# Of those, the ones a request model may have as fields (tool calling on the chat route): refused only where it
# has not. The others are refused by value even where they are fields (best_of without beam search).
_FIELDS_OF_SOME_ROUTES = frozenset({"tools", "tool_choice"})


class JsonSchemaFormat(_Lenient):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: the output is always
    held to the schema (with closed objects, as strict mode has them; ``engine.grammar``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # ``schema`` would shadow BaseModel.schema(); absent, any JSON object will do (as json_object).
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response_format needs its json_schema object")
        self.spec()  # a GrammarError (a ValueError) is a 400 now, before anything is compiled
        return self

    def spec(self) -> GrammarSpec | None:
        """The grammar the reply must follow; None for text."""
        if self.type == "text":
            return None
        if self.json_schema is None or self.json_schema.schema_ is None:
            return GrammarSpec.json_object()
        return GrammarSpec.json_schema(self.json_schema.schema_)


class SamplingFields(_Lenient):
    """Sampling knobs shared by the OpenAI routes, session messages and WebSocket frames."""

    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    # Near 0 it divides logits by ~0 (inf, then NaN); far above any useful value it does the same the other way.
    repetition_penalty: Annotated[float, Field(ge=0.01, le=10.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    # Structured outputs; the caller compiles ``grammar()`` (chatsvc.structured) before it stores or queues.
    response_format: ResponseFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        return None if self.response_format is None else self.response_format.spec()

    def checked_grammar(self) -> GrammarSpec | None:
        """The grammar the gateway compiles, before anything is stored or queued, to refuse a bad one."""
        return self.grammar()

    def grammar_param(self) -> str:
        """The request field a grammar error is reported against."""
        return "response_format"

    @model_validator(mode="before")
    @classmethod
    def _no_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, harmless in _UNSUPPORTED.items():
                supported_here = name in _FIELDS_OF_SOME_ROUTES and name in cls.model_fields
                if name in data and not supported_here and not harmless(data[name], data):
                    raise APIError(400, f"'{name}' is not supported by this server", code="unsupported_parameter",
                                   param=name)
        return data

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 8:
            raise ValueError("at most 8 stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in items):
            raise ValueError(f"stop strings are limited to {MAX_STOP_CHARS} characters")
        return v

    def sampling_params(self, max_tokens: int, n: int = 1, logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; a combination the engine refuses is a 400 (``invalid_value``)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                n=n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=self.top_k or 0,
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=self.repetition_penalty or 1.0,
                seed=self.seed,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=min(self.min_tokens, max_tokens),
                logprobs=logprobs,
                grammar=self.grammar(),
                **self._beam_params(),
            )
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value") from exc

    def _beam_params(self) -> dict[str, Any]:
        return {}


TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit


class FunctionDef(_Lenient):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    description: Annotated[str, Field(max_length=16_000)] | None = None
    # A JSON schema of the arguments object; absent, the function takes none.
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # accepted either way: the arguments are always held to the schema


class ToolDef(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_Lenient):
    name: Annotated[str, Field(pattern=TOOL_NAME)]
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Lenient):
    id: Annotated[str, Field(min_length=1, max_length=128)]
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolFields(SamplingFields):
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (chatsvc/tools.py): with
    ``required`` or a named function the reply is calls, with ``auto`` (the default with tools) text or
    calls, with ``none`` text and the tools are not shown to the model."""

    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tools_consistent(self) -> ToolFields:
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice requires tools")
        if self.calls_tools() and self.response_format is not None and self.response_format.type != "text":
            raise ValueError('response_format cannot be combined with tools unless tool_choice is "none"')
        self.tool_spec()  # a GrammarError (a ValueError) is a 400 now, before anything is compiled
        return self

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or ()]

    def calls_tools(self) -> bool:
        """The model is shown the tools and may (or must) call them."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_spec(self) -> GrammarSpec | None:
        """The reply's grammar for the tool choice; with ``none``, that of ``auto`` (so that a bad tool list
        is refused whatever the choice), which the caller checks and does not use."""
        if not self.tools:
            return None
        choice = self.tool_choice if self.tool_choice not in (None, "none") else "auto"
        return tool_call_spec(self.tool_dicts(), choice.model_dump() if isinstance(choice, BaseModel) else choice,
                              self.parallel_tool_calls is not False)

    def grammar(self) -> GrammarSpec | None:
        return self.tool_spec() if self.calls_tools() else super().grammar()

    def checked_grammar(self) -> GrammarSpec | None:
        """The grammar the gateway compiles before anything is stored or queued: also ``none``'s tools."""
        return self.tool_spec() if self.tools else super().grammar()

    def grammar_param(self) -> str:
        return "tools" if self.tools else "response_format"


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's calls
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None  # the call a tool answers

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role}")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs the tool_call_id it answers, and only a tool message has one")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def openai(self) -> dict[str, Any]:
        """The message as chatsvc.tools renders it (``developer`` is a system message to the template)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class StreamOptions(_Lenient):
    include_usage: bool = False


class _OpenAIBase(SamplingFields):
    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's beam search extension. Its answer exists only when the search is done, so a streamed request
    # gets each beam whole in one chunk at the end.
    use_beam_search: bool = False
    best_of: Annotated[int, Field(ge=1)] | None = None
    length_penalty: Annotated[float, Field(ge=-10.0, le=10.0)] = 1.0
    early_stopping: bool | Literal["never"] = False

    def _beam_params(self) -> dict[str, Any]:
        if not self.use_beam_search:
            return {}
        # Beam search does not sample: the OpenAI default temperature of 1 is no request for sampling.
        return {"use_beam_search": True, "best_of": self.best_of, "length_penalty": self.length_penalty,
                "early_stopping": self.early_stopping}


class ChatCompletionRequest(_OpenAIBase, ToolFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("messages")
    @classmethod
    def _content_present(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        for i, m in enumerate(v):
            if m.role not in ("assistant", "tool") and not m.text().strip():
                raise ValueError(f"message {i} ({m.role}) has empty content")
        called: set[str] = set()
        for i, m in enumerate(v):
            called.update(c.id for c in m.tool_calls or ())
            if m.role == "tool" and m.tool_call_id not in called:
                raise ValueError(f"message {i} (tool) answers tool_call_id {m.tool_call_id!r}, which no earlier "
                                 "assistant message called")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_OpenAIBase):
    prompt: str | Annotated[list[int], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_nonempty(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if v == "" or (isinstance(v, list) and v and v[0] == ""):
            raise ValueError("prompt must not be empty")
        return v


class PersonaBody(_Lenient):
    system_prompt: Annotated[str, Field(min_length=1, max_length=16_000)]
    description: Annotated[str, Field(max_length=1000)] = ""


class SessionCreate(_Lenient):
    persona: str | None = None
    title: Annotated[str, Field(max_length=200)] | None = None
    # Every turn's, unless a message sends its own (chatsvc.session_ops).
    response_format: ResponseFormat | None = None

    def grammar(self) -> GrammarSpec | None:
        return None if self.response_format is None else self.response_format.spec()

    def stored_response_format(self) -> str:
        """As the store keeps it: JSON text, "" for none (plain text is none)."""
        rf = self.response_format
        return "" if rf is None or rf.type == "text" else rf.model_dump_json(by_alias=True, exclude_none=True)


class SessionUpdate(SessionCreate):
    """PATCH of a session's settings: only the fields sent change; ``"response_format": null`` clears it."""

    @model_validator(mode="after")
    def _no_persona(self) -> SessionUpdate:
        if self.persona is not None:
            raise ValueError("a session's persona is fixed when it is created")
        return self


class SessionMessage(ToolFields):
    """A user message, or (``role: "tool"``) the result of one of the session's tool calls."""

    content: Annotated[str, Field(min_length=1)]
    role: Literal["user", "tool"] = "user"
    tool_call_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None

    @field_validator("content")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("content must not be blank")
        return v

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> SessionMessage:
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError('a tool result (role "tool") needs the tool_call_id it answers, and only it has one')
        return self

    def stored(self) -> dict[str, Any]:
        """The message as the session stores it (chatsvc.turns adds its time and tokens)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int, default: int | None) -> int:
    """OpenAI semantics: the prompt must fit and leave room for the requested completion."""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{prompt_len} tokens.", code="context_length_exceeded", param="messages")
    room = max_model_len - prompt_len
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"max_tokens ({requested}) plus the prompt ({prompt_len} tokens) exceeds the "
                       f"maximum context length of {max_model_len} tokens", code="context_length_exceeded",
                       param="max_tokens")
    return requested


SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# "turn:stream-id", a bare stream id, or "turn:" (a Redis stream id is "ms-seq", "ms" alone or "0").
# ASCII digits only (``\d`` alone also matches other scripts' digits), matched whole (``$`` would let a
# trailing newline through); each stream-id part must also fit Redis's 64-bit integers.
EVENT_ID = re.compile(r"(?:\d{1,9}:)?(?:(\d{1,20})(?:-(\d{1,20}))?)?", re.ASCII)


def session_not_found(sid: str) -> APIError:
    return APIError(404, f"session {sid[:80]!r} not found", code="session_not_found", param="session_id")


def check_session_id(sid: str) -> None:
    """A session id the store never issued (``<id>:messages``, ``../x``) is a 404, never a store lookup."""
    if not SESSION_ID.match(sid):
        raise session_not_found(sid)


def check_event_id(value: str | None, param: str = "after") -> None:
    match = EVENT_ID.fullmatch(value) if value else None
    if value and (match is None or any(int(part) >= 1 << 64 for part in match.groups() if part)):
        raise APIError(400, f"{param} must be an event id ('turn:stream-id') as sent in a reply",
                       code="invalid_value", param=param)
