"""Request state: sampling parameters, sequences and the groups they form.

A request is one ``SequenceGroup``. It starts with a single sequence holding the prompt; when
``n > 1`` the sequence forks into ``n`` once the prompt is computed, and the forks share the
prompt's KV blocks by reference count. The group is the unit of scheduling and preemption.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from math import isfinite
from typing import TYPE_CHECKING, Any, Literal

from engine.beam import BeamSearch
from engine.grammar import GrammarSpec

if TYPE_CHECKING:
    from engine.grammar import CompiledGrammar, GrammarState


MAX_CACHE_SALT_CHARS = 256


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """What to generate and how; mirrors vLLM's ``SamplingParams`` where it has one."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # Draws of the seeded generator to skip before the first token: the tokens an earlier dispatch of this
    # request already sampled (a failover re-dispatches it with those tokens in the prompt), so the seeded
    # stream goes on where it was instead of starting again. A request with a grammar counts them too: its
    # grammar starts past the last ``seed_offset`` prompt tokens, where the reply is.
    seed_offset: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Beam search (vLLM's extension): ``best_of`` beams, the ``n`` best returned. Scored like transformers'
    # ``generate(num_beams=best_of)``: sum of log-probabilities / generated length ** length_penalty.
    use_beam_search: bool = False
    best_of: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # Structured output (``engine.grammar``): the reply follows this JSON schema or tool-call grammar. A spec,
    # not a compiled grammar, so that it crosses every transport; each engine compiles it for its tokenizer.
    grammar: GrammarSpec | None = None
    # The request's true output length, for benchmarks of the paper's Orca baselines only: under
    # kv_reservation "pow2" / "oracle" admission reserves KV for it (a trace knows it; a live request does not).
    reserve_output_tokens: int | None = None
    # Prefix-cache isolation (vLLM's ``cache_salt``): mixed into the hash of every prompt block past the first
    # ``shared_prefix_tokens`` tokens, so only requests with the same salt hit those blocks and a hit count
    # never tells one tenant what another sent. The leading blocks wholly inside ``shared_prefix_tokens`` (a
    # shared persona's prompt, the same for everyone) hash without it, so every salt shares them.
    cache_salt: str | None = None
    shared_prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.grammar, Mapping):  # its JSON form, as engine.protocol decodes it
            self.grammar = _grammar_spec(self.grammar)
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.seed_offset, int) or self.seed_offset < 0:
            raise ValueError(f"seed_offset must be an integer >= 0, got {self.seed_offset!r}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters")
        if (isinstance(self.shared_prefix_tokens, bool) or not isinstance(self.shared_prefix_tokens, int)
                or self.shared_prefix_tokens < 0):
            raise ValueError(f"shared_prefix_tokens must be an integer >= 0, got {self.shared_prefix_tokens!r}")
        if self.reserve_output_tokens is not None and (
                not isinstance(self.reserve_output_tokens, int) or self.reserve_output_tokens < 1
                or (self.max_tokens is not None and self.reserve_output_tokens > self.max_tokens)):
            raise ValueError(f"reserve_output_tokens must be an integer in [1, max_tokens], "
                             f"got {self.reserve_output_tokens!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be true, false or 'never', got {self.early_stopping!r}")
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")
        if self.use_beam_search:
            self._validate_beam_search()
        elif self.best_of not in (None, self.n):
            raise ValueError("best_of > n needs use_beam_search (sampling returns every sample it draws)")
        elif self.length_penalty != 1.0 or self.early_stopping is not False:
            raise ValueError("length_penalty and early_stopping apply to beam search only")

    def _validate_beam_search(self) -> None:
        """Beam search ranks continuations by the model's log-probabilities: the knobs that reshape a sampling
        distribution, per-token logprobs of a beam that may later be dropped, and stop strings (which would
        need every candidate detokenized) are refused rather than silently ignored."""
        if self.beam_width < 2:
            # As vLLM: one beam is greedy decoding (transformers' num_beams=1 is), so ask for that instead.
            raise ValueError(f"beam search needs best_of (or n) >= 2, got {self.beam_width}")
        if self.top_p != 1.0 or self.top_k not in (0, -1) or self.min_p != 0.0:
            raise ValueError("beam search does not sample: top_p, top_k and min_p must be left at their defaults")
        if self.seed is not None:
            raise ValueError("beam search is deterministic: seed does not apply")
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported with beam search")
        if self.stop:
            raise ValueError("stop strings are not supported with beam search; use stop_token_ids")
        if not isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty}")
        if self.grammar is not None:
            # Beams are ranked on the model's own log-probabilities, which a mask would silently reshape.
            raise ValueError("beam search does not take structured outputs (response_format, a grammar)")

    @property
    def greedy(self) -> bool:
        """Pick the most likely token. Beam search rows count as greedy: the token the sampler picks for them
        is not used (the beam step chooses from their candidates), and argmax is the cheapest pick."""
        return self.temperature < 1e-5 or self.use_beam_search

    @property
    def beam_width(self) -> int:
        """Beams kept by beam search (``best_of``, ``n`` when unset); 0 without beam search."""
        return (self.best_of or self.n) if self.use_beam_search else 0

    @property
    def max_seqs(self) -> int:
        """Sequences the request may hold at once: its beams, or its ``n`` samples."""
        return self.beam_width or self.n


def _grammar_spec(data: Mapping[str, Any]) -> GrammarSpec:
    """A ``GrammarSpec`` from its JSON form (``dataclasses.asdict``'s): exactly its fields, of their types."""
    unknown = set(data) - {"kind", "schema", "parallel"}
    if unknown:
        raise ValueError(f"unknown grammar fields: {sorted(unknown)[:5]}")
    kind, schema, parallel = data.get("kind"), data.get("schema", ""), data.get("parallel", False)
    if not (isinstance(kind, str) and isinstance(schema, str) and isinstance(parallel, bool)):
        raise ValueError("grammar must be {\"kind\": str, \"schema\": str, \"parallel\": bool}")
    return GrammarSpec(kind, schema, parallel)  # type: ignore[arg-type]  # __post_init__ checks the kind


@dataclass(frozen=True)
class CacheSalt:
    """What a sequence's prefix-cache hashes mix in (``SamplingParams.cache_salt``): ``salt`` for every block
    that reaches past the first ``shared_tokens`` tokens, nothing for the blocks wholly inside them."""

    salt: bytes = b""
    shared_tokens: int = 0

    @classmethod
    def of(cls, params: SamplingParams) -> CacheSalt:
        if params.cache_salt is None:
            return cls()
        return cls(params.cache_salt.encode(), params.shared_prefix_tokens)

    def for_block(self, index: int, block_size: int) -> bytes:
        """The salt of the ``index``-th full block: a block holding any token past the shared prefix is the
        requester's own, and so is every block after it (the hash chain carries it on anyway)."""
        return self.salt if (index + 1) * block_size > self.shared_tokens else b""


_seq_counter = itertools.count()


class Sequence:
    """One token stream. KV exists for ``token_ids[:num_computed_tokens]``."""

    def __init__(self, token_ids: list[int], num_prompt_tokens: int, index: int = 0,
                 cache_salt: CacheSalt | None = None) -> None:
        self.seq_id: int = next(_seq_counter)
        self.cache_salt = cache_salt or CacheSalt()
        self.index = index  # sample index within its group (the OpenAI ``choices[i].index``)
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_text = ""
        self.output_logprobs: list[dict[int, float]] = []
        # Where the output is in its request's grammar (None without one). It follows the accepted output
        # tokens only, so a preemption (recompute or swap) leaves it as it is.
        self.grammar: GrammarState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def fork(self, index: int) -> Sequence:
        child = Sequence(self.token_ids, self.num_prompt_tokens, index, self.cache_salt)
        child.num_computed_tokens = self.num_computed_tokens
        child.output_text = self.output_text
        child.output_logprobs = list(self.output_logprobs)
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"finish={self.finish_reason})")


class SequenceGroup:
    """A request: its sequences (one before the fork, ``n`` after), parameters and timings."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 arrival_time: float | None = None, prompt: str | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt = prompt
        self.sampling_params = sampling_params
        self._prompt_token_ids = tuple(prompt_token_ids)
        self.cache_salt = CacheSalt.of(sampling_params)
        self.seqs: list[Sequence] = [Sequence(prompt_token_ids, len(prompt_token_ids), cache_salt=self.cache_salt)]
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # Beam search state (scores, finished hypotheses); its beams are ``seqs`` until it finishes, then
        # ``seqs`` holds the ``n`` best hypotheses.
        self.beam = BeamSearch(sampling_params.beam_width, sampling_params.length_penalty,
                               sampling_params.early_stopping) if sampling_params.use_beam_search else None
        # The request's grammar compiled by the engine that runs it; each sequence copies its start state.
        self.grammar: CompiledGrammar | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._prompt_token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        # Kept apart from the sequences: a beam search drops all of its beams before its results replace them.
        return list(self._prompt_token_ids)

    @property
    def needs_fork(self) -> bool:
        """Whether the single sequence still has to fork into ``n`` samples (beam search forks by itself)."""
        return self.beam is None and self.sampling_params.n > len(self.seqs)

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, {self.status.value}, seqs={self.seqs})"


@dataclass(frozen=True)
class RequestLimits:
    """The engine's bounds a request is checked against before it is queued."""

    max_num_seqs: int
    vocab_size: int
    max_model_len: int


def make_request(limits: RequestLimits, encode: Callable[[str], list[int]], request_id: str,
                 sampling_params: SamplingParams, prompt: str | None = None,
                 prompt_token_ids: list[int] | None = None,
                 arrival_time: float | None = None) -> SequenceGroup:
    """Validate a request and build its group; ValueError says what is wrong.

    One function for the engine and for clients of an engine in another process, so a request is
    refused by the same rules wherever it is checked.
    """
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError("sampling_params must be a SamplingParams")
    sampling_params.validate()
    if sampling_params.max_seqs > limits.max_num_seqs:
        what = "best_of" if sampling_params.use_beam_search else "n"
        raise ValueError(f"{what}={sampling_params.max_seqs} exceeds max_num_seqs={limits.max_num_seqs}")
    if prompt_token_ids is None:
        if prompt is None:
            raise ValueError("prompt or prompt_token_ids is required")
        prompt_token_ids = encode(prompt)
    prompt_token_ids = list(prompt_token_ids)
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    vocab = limits.vocab_size
    if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
        raise ValueError(f"prompt_token_ids must be integers in [0, {vocab})")
    if len(prompt_token_ids) >= limits.max_model_len:
        raise ValueError(f"prompt is {len(prompt_token_ids)} tokens; the context length (max_model_len) is "
                         f"{limits.max_model_len}, leaving no room for output")
    return SequenceGroup(request_id, prompt_token_ids, sampling_params, arrival_time=arrival_time, prompt=prompt)
