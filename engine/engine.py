"""The step loop: schedule -> run -> sample -> update -> outputs.

``LLMEngine`` is synchronous and single-threaded; ``engine.llm.LLM`` drives it for offline use and
``engine.core.EngineCore`` runs it behind every transport the gateway uses (a thread, a child process, a Redis
worker).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.beam import end_tokens
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.distributed import RankDiedError, make_runner, rank_zero, threads_per_rank
from engine.grammar import GrammarCompiler, GrammarError, GrammarState
from engine.grammar_masks import MaskFiller, PendingMasks
from engine.kv_disk import DiskStore
from engine.kv_host import TierIO, block_format
from engine.kv_tiers import KVTiers
from engine.loader import load_model
from engine.model.linear import onednn_supports
from engine.plan import ScheduledSeq, SchedulerOutput, TierPlan
from engine.protocol import EngineStats, KVSnapshot, RequestDelta
from engine.request import (
    CacheSalt,
    RequestLimits,
    RequestStatus,
    SamplingParams,
    Sequence,
    SequenceGroup,
    make_request,
)
from engine.runner import ModelRunner, kv_bytes_per_block, kv_pool
from engine.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from engine.scheduler import PreemptionCosts, Scheduler
from engine.threads import ThreadGovernor
from kernels import get_backend

log = logging.getLogger("chatsvc.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """A dtype name, or "auto": bfloat16 where the device multiplies it natively (CUDA with bf16; a CPU
    with AVX512-BF16 or AMX, as oneDNN reports), float32 elsewhere, where bf16 GEMMs run several times
    slower than float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if onednn_supports(torch.bfloat16, device) else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_swap(runner: ModelRunner, num_blocks: int = 8, repeats: int = 3) -> tuple[int, float]:
    """(blocks moved one way, seconds): the runner's own swap kernel moving ``num_blocks`` blocks of its cache's
    shape between scratch device and CPU pools, out and back ``repeats`` times after one warm-up."""
    shape = (*runner.kv_cache.shape[:2], num_blocks, *runner.kv_cache.shape[3:])
    dtype = runner.kv_cache.dtype
    device_pool = kv_pool(shape, dtype, runner.device)
    cpu_pool = kv_pool(shape, dtype, "cpu", pin_memory=runner.device.type == "cuda")
    mapping = torch.arange(num_blocks, dtype=torch.int64).repeat(2, 1).T.contiguous()
    runner.backend.swap_blocks(device_pool, cpu_pool, mapping)
    _synchronize(runner.device)
    started = time.perf_counter()
    for _ in range(repeats):
        runner.backend.swap_blocks(device_pool, cpu_pool, mapping)
        runner.backend.swap_blocks(cpu_pool, device_pool, mapping)
    _synchronize(runner.device)
    return 2 * repeats * num_blocks, time.perf_counter() - started


class LLMEngine:
    def __init__(self, config: EngineConfig, *, fault_request_prefix: str | None = None) -> None:
        """``fault_request_prefix`` is a test hook: the model run of any step that schedules a request whose
        id starts with it raises, as a bug or a bad input inside the forward pass would. Not a setting of
        ``EngineConfig``, so no flag or API request can turn it on."""
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' requested but CUDA is not available")
        tp = None
        if config.tensor_parallel_size > 1:
            tp = rank_zero(config)  # refuses on a launched rank other than 0: those run engine.tp_rank
            torch.set_num_threads(threads_per_rank(config))
        elif config.engine_threads is not None:
            torch.set_num_threads(config.engine_threads)
        # Ranks wait for each other at every all-reduce: one rank varying its threads would only stall the rest.
        adaptive = bool(config.adaptive_threads) and config.tensor_parallel_size == 1
        self.threads = ThreadGovernor(torch.get_num_threads()) if adaptive else None
        self.config = config
        self.dtype = resolve_dtype(config.dtype, config.device)
        backend = get_backend(config.attention_backend, config.device)
        loaded = load_model(config.model, self.dtype, config.device, backend, config.linear_backend, tp=tp,
                            quantization=config.quantization)
        self.model_path = loaded.path
        self.model_name = loaded.config.name or loaded.path.stem
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.config.eos_token_ids
        self._grammars = self._build_grammar_compiler()

        # Per rank under tensor parallelism: each holds its own KV heads of every block.
        self.block_bytes = kv_bytes_per_block(loaded.model.layer_config, config.block_size, self.dtype)
        self.cache_config = config.cache_config(self.block_bytes)
        self.scheduler_config = config.scheduler_config(loaded.config.max_position_embeddings, self.cache_config)
        cache = self.cache_config
        self.block_manager = BlockManager(cache.block_size, cache.num_device_blocks, cache.num_cpu_blocks,
                                          cache.enable_prefix_caching, str(self.model_path).encode())
        self.runner: ModelRunner = make_runner(loaded.model, backend, cache, self.dtype, config)
        costs = PreemptionCosts()
        if self.scheduler_config.preemption_mode == "auto" and cache.num_cpu_blocks:  # without them: recompute
            costs.observe_swap(*measure_swap(self.runner))
        self.tiers, self.tier_io = self._make_tiers(config)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, costs, self.tiers)
        self.sampler = Sampler(backend.argmax)
        self._groups: dict[str, SequenceGroup] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._generators: dict[int, torch.Generator | None] = {}
        # Ready before the first step (see _build_grammar_compiler); usually done by now, the KV pool and runner
        # having taken longer.
        wait([self._grammars])
        self._fault_prefix = fault_request_prefix
        self._failures: list[tuple[str, BaseException]] = []
        self._mask_filler: MaskFiller | None = None  # made at the first grammar row

    def _make_tiers(self, config: EngineConfig) -> tuple[KVTiers | None, TierIO | None]:
        if not self.cache_config.num_host_blocks:
            return None, None
        disk = None
        if config.kv_disk_bytes and config.kv_disk_dir:
            fmt = block_format(self.runner.host_cache, str(self.model_path), self.dtype)
            disk = DiskStore(config.kv_disk_dir, fmt, config.kv_disk_bytes)
        tiers = KVTiers(self.block_manager, self.cache_config.num_host_blocks, disk)
        if config.kv_host_preload:
            tiers.start_preload()
        return tiers, TierIO(self.runner.host_cache, tiers, disk, self.runner.kv_cache)

    def close(self) -> None:
        """Put the host tier's blocks on disk and finish the writes: a restart on the same directory finds
        them. The engine may go on serving afterwards."""
        if self.tier_io is not None:
            self.tier_io.close()
        if self._mask_filler is not None:
            self._mask_filler.close()
            self._mask_filler = None

    @classmethod
    def from_args(cls, model: str | None = None, *, fault_request_prefix: str | None = None,
                  **settings: Any) -> LLMEngine:
        """Keyword form: the settings are ``EngineConfig``'s fields."""
        return cls(EngineConfig(model=model, **settings), fault_request_prefix=fault_request_prefix)

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.scheduler_config.max_num_seqs, self.model_config.vocab_size, self.max_model_len)

    # -- requests ---------------------------------------------------------------------------------
    def make_request(self, request_id: str, sampling_params: SamplingParams, prompt: str | None = None,
                     prompt_token_ids: list[int] | None = None) -> SequenceGroup:
        """Validate a request and build its group without touching engine state."""
        return make_request(self.request_limits, self.tokenizer.encode, request_id, sampling_params, prompt,
                            prompt_token_ids)

    def _build_grammar_compiler(self) -> Future[GrammarCompiler]:
        """The compiler, built on a thread while the rest of the engine starts. Its tokenizer index costs
        about a second for a 49k vocabulary, most of it in llguidance's Rust with the GIL held: built lazily
        on or beside the step loop, it stalled every running request's step for that long. Built here, the
        engine pays it once at start, overlapped with the runner and KV pool coming up."""
        future: Future[GrammarCompiler] = Future()

        def build() -> None:
            try:
                future.set_result(GrammarCompiler.from_hf(self.tokenizer.hf, self.model_config.vocab_size,
                                                          self.eos_token_ids))
            except Exception as exc:  # noqa: BLE001 - kept for the grammar requests, which it refuses
                future.set_exception(exc)

        threading.Thread(target=build, name="grammar-compiler", daemon=True).start()
        return future

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """``GrammarError`` where this model's tokenizer cannot drive llguidance (a slow tokenizer): such an
        engine serves every other request."""
        try:
            return self._grammars.result()
        except Exception as exc:
            raise GrammarError(f"structured outputs are not available for this model's tokenizer: {exc}"
                               ) from exc

    def add_group(self, group: SequenceGroup) -> None:
        if group.request_id in self._groups:
            raise ValueError(f"request id {group.request_id!r} is already in use")
        spec = group.sampling_params.grammar
        if spec is not None and group.grammar is None:
            # A GrammarError is a ValueError: the request is refused before it is queued. Cached by the spec's
            # key, so only a schema's first request waits for its compile (milliseconds).
            group.grammar = self.grammar_compiler.compile(spec)
        self.scheduler.add(group)
        self._groups[group.request_id] = group

    def add_request(self, request_id: str, sampling_params: SamplingParams, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> SequenceGroup:
        group = self.make_request(request_id, sampling_params, prompt, prompt_token_ids)
        self.add_group(group)
        return group

    def abort_request(self, request_id: str) -> list[RequestDelta]:
        group = self.scheduler.abort(request_id)
        return [] if group is None else self._finish_request(group)

    def has_unfinished(self) -> bool:
        """Requests to run, or disk reads (a warm's) to install: both need steps."""
        return self.scheduler.has_unfinished() or (self.tiers is not None and self.tiers.reading)

    def has_background_work(self) -> bool:
        """The start-up preload of the host tier (engine.kv_tiers) is not done: a server keeps stepping for
        it while idle. Apart from ``has_unfinished``, so that a loop that runs its own requests to the end
        (``LLM.generate``) does not wait for it; every step advances it all the same."""
        return self.tiers is not None and self.tiers.preloading

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        if self.tier_io is not None:
            self.tier_io.install_reads()
        out = self.scheduler.schedule()
        deltas: list[RequestDelta] = []
        for group in out.ignored:
            deltas.extend(self._finish_request(group))
        if out.is_empty:
            if self.tiers is not None and (self.tiers.reading or self.tiers.preloading):
                # Only disk reads are left to wait for: wait on them rather than spin through empty steps.
                wait(self.tiers.reads_in_flight(), timeout=0.05, return_when=FIRST_COMPLETED)
            return deltas
        # The block plans run once: swapped-out blocks may be reused by this very step's sequences, so
        # running them again after a failed forward would copy overwritten KV.
        self._execute_block_plans(out)
        out = dataclasses.replace(out, blocks_to_swap_out=(), blocks_to_swap_in=(), blocks_to_copy=(),
                                  tiers=TierPlan())
        masks = self._prefetch_masks(out)  # on the filler's thread while the forward runs
        now = time.perf_counter()
        threads = self._set_threads(out, now)
        started: float | None = now
        try:
            logits, samplers = self._forward(out)
        except RankDiedError:
            raise  # no request's fault: the engine has lost a shard of its model
        except Exception as exc:  # noqa: BLE001 - isolated below; only the culprits fail
            log.warning("engine step failed (%s); isolating the request(s) that caused it", exc)
            logits, samplers, out = self._isolate(out, exc)
            started = None  # a re-run in parts is no measure of a prefill
        self.scheduler.update(out)
        if logits is None:
            return deltas
        rows = self._sampling_rows(samplers)
        result = self._sample(logits, rows, masks)  # its token ids are on the host: the step's work is done
        if started is not None:
            ended = time.perf_counter()
            self._observe_prefill(out, ended - started)
            if self.threads is not None:
                self.threads.observe(threads, out.num_batched_tokens, ended - started, ended)
        deltas.extend(self._postprocess(rows, result))
        return deltas

    def _set_threads(self, out: SchedulerOutput, now: float) -> int:
        """The thread count this step runs on: the governor's choice, or whatever torch has."""
        if self.threads is None:
            return torch.get_num_threads()
        prefill = any(s.num_new_tokens > 1 for s in out.scheduled)
        threads = self.threads.choose(out.num_batched_tokens, now, prefill=prefill)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        return threads

    # -- what preemption costs (for preemption_mode="auto") -----------------------------------------
    def _execute_block_plans(self, out: SchedulerOutput) -> None:
        moved = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        started = time.perf_counter()
        if self.tier_io is not None:
            self.tier_io.spill(out.tiers.spill)  # before the offloads overwrite those host blocks
        self.runner.execute_block_plans(out)
        if moved:
            _synchronize(self.runner.device)
            self.scheduler.costs.observe_swap(moved, time.perf_counter() - started)

    def _observe_prefill(self, out: SchedulerOutput, seconds: float) -> None:
        """Steps that are mostly prefill measure a prefill token's cost; decode-heavy ones would charge each
        token a whole sequence's attention and step overhead."""
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1)
        if 2 * prefill >= out.num_batched_tokens > 0:
            self.scheduler.costs.observe_prefill(out.num_batched_tokens, seconds)

    def take_failures(self) -> list[tuple[str, BaseException]]:
        """Requests that a step failed and aborted since the last call: (request id, what its stream raises)."""
        failures, self._failures = self._failures, []
        return failures

    def _forward(self, out: SchedulerOutput) -> tuple[torch.Tensor | None, tuple[ScheduledSeq, ...]]:
        if self._fault_prefix is not None:
            for item in out.scheduled:
                if item.group.request_id.startswith(self._fault_prefix):
                    raise RuntimeError(f"injected fault for request {item.group.request_id!r}")
        return self.runner.execute(out)

    def _isolate(self, out: SchedulerOutput, exc: Exception
                 ) -> tuple[torch.Tensor | None, tuple[ScheduledSeq, ...], SchedulerOutput]:
        """Re-run a failed step's requests in halves until each failing part is a single request; those
        requests are aborted (their blocks freed) and reported through ``take_failures``, the rest of the
        step completes. Each request's tokens are recomputed at the same positions and slots, so a retry
        overwrites whatever the failed run left in its KV. A request that raises every time fails alone,
        once, and never runs again: no livelock. The one exception to "alone": a request that took a
        culprit's prompt blocks from the prefix cache in this same step (identical prompts arriving
        together) read KV that was never written, and fails with it."""
        groups = list(dict.fromkeys(item.group for item in out.scheduled))
        parts: list[tuple[torch.Tensor | None, tuple[ScheduledSeq, ...], tuple[ScheduledSeq, ...]]] = []
        culprits: list[tuple[SequenceGroup, BaseException]] = []
        # A part with a known error is split (or, alone, is a culprit) without running it again.
        pending: list[tuple[list[SequenceGroup], BaseException | None]] = [(groups, exc)]
        while pending:
            part, known = pending.pop(0)
            if not part:
                continue
            items = tuple(item for item in out.scheduled if item.group in part)
            error = known
            if error is None:
                try:
                    logits, samplers = self._forward(dataclasses.replace(out, scheduled=items))
                    parts.append((logits, samplers, items))
                    continue
                except Exception as err:  # noqa: BLE001 - narrowed down further
                    error = err
            if len(part) > 1:
                half = len(part) // 2
                pending[:0] = [(part[:half], None), (part[half:], None)]
                continue
            culprits.append((part[0], error))
        # A culprit's blocks past its computed tokens never got their KV: out of the prefix cache with
        # them. A request that hit one of them in this same step read that missing KV, so it fails too.
        bm = self.block_manager
        unwritten: set[int] = set()
        for group, error in culprits:
            log.error("request %s fails the engine step: %s", group.request_id, error)
            for seq in group.seqs:
                unwritten.update(bm.block_table(seq)[seq.num_computed_tokens // bm.block_size :])
            self._fail_request(group, f"engine error: {error}")
        victims = {item.group for _, _, items in parts for item in items
                   if unwritten.intersection(bm.block_table(item.seq))}
        for group in victims:  # its own new blocks were computed from that missing KV
            self._fail_request(group, "engine error: this request shared prompt blocks with a request that "
                                      "failed the step")
        done = tuple(item for _, _, items in parts for item in items if item.group not in victims)
        # A part's logits are None exactly when none of its sequences samples.
        sampling = [s for _, part_samplers, _ in parts for s in part_samplers]
        keep = [i for i, s in enumerate(sampling) if s.group not in victims]
        logits = torch.cat([rows for rows, _, _ in parts if rows is not None])[keep] if keep else None
        return logits, tuple(sampling[i] for i in keep), dataclasses.replace(out, scheduled=done)

    def _fail_request(self, group: SequenceGroup, message: str) -> None:
        """Abort a request that failed the step; its blocks leave the prefix cache (their KV is not there)."""
        for seq in group.seqs:
            self.block_manager.abandon(seq)
        self.abort_request(group.request_id)
        self._failures.append((group.request_id, RuntimeError(message)))

    def _sampling_rows(self, samplers: tuple[ScheduledSeq, ...]) -> list[tuple[int, SequenceGroup, Sequence]]:
        """(logits row, group, sequence) of each sequence that samples this step. A group of n > 1 forks
        when its prompt is done: the children share the parent's blocks and sample from its logits row."""
        rows: list[tuple[int, SequenceGroup, Sequence]] = []
        for i, item in enumerate(samplers):
            group = item.group
            seqs = [item.seq]
            if group.needs_fork and item.seq is group.seqs[0]:
                seqs += self.scheduler.fork(group)
            rows.extend((i, group, seq) for seq in seqs)
        return rows

    @property
    def mask_filler(self) -> MaskFiller:
        if self._mask_filler is None:
            self._mask_filler = MaskFiller(self.grammar_compiler.vocab_size)
        return self._mask_filler

    def _prefetch_masks(self, out: SchedulerOutput) -> PendingMasks | None:
        """Starts the masks of this step's sampling rows that follow a grammar. Their states stay put until
        ``_postprocess`` accepts the step's tokens, after ``_sample`` has waited for the masks."""
        items = [item for item in out.scheduled if item.samples and item.group.grammar is not None]
        if not items:
            return None
        states = [self._grammar_state(item.group, item.seq) for item in items]
        return PendingMasks(tuple(item.seq.seq_id for item in items), self.mask_filler.ceilings(states))

    def _sample(self, logits: torch.Tensor, rows: list[tuple[int, SequenceGroup, Sequence]],
                masks: PendingMasks | None = None) -> SamplerOutput:
        if len(rows) != logits.shape[0]:
            logits = logits[torch.tensor([i for i, _, _ in rows], device=logits.device)]
        states = {r: self._grammar_state(g, s) for r, (_, g, s) in enumerate(rows) if g.grammar is not None}
        ceilings = self._grammar_ceilings([rows[r][2].seq_id for r in states], list(states.values()), masks)
        groups, seqs = [g for _, g, _ in rows], [s for _, _, s in rows]
        batch = SamplingBatch([g.sampling_params for g in groups], [s.prompt_token_ids for s in seqs],
                              [s.output_token_ids for s in seqs], [self._generator(g, s) for _, g, s in rows],
                              self.eos_token_ids, grammar_rows=tuple(states), grammar_ceilings=ceilings)
        return self.sampler(logits, batch)

    def _grammar_ceilings(self, seq_ids: list[int], states: list[GrammarState], masks: PendingMasks | None
                          ) -> torch.Tensor | None:
        """The ceilings of ``states`` (of ``seq_ids``), a row each: the prefetched ones, and the rest filled now
        (the ``n`` samples forked after their prompt: they did not exist before the forward)."""
        if not states:
            return None
        ready = masks.ceilings.result() if masks is not None else None
        at = {seq_id: i for i, seq_id in enumerate(masks.seq_ids)} if masks is not None else {}
        missing = [i for i, seq_id in enumerate(seq_ids) if seq_id not in at]
        if not missing and ready is not None:
            picks = [at[seq_id] for seq_id in seq_ids]
            return ready if picks == list(range(ready.shape[0])) else ready[picks]
        filled = self.mask_filler.ceilings([states[i] for i in missing]).result()
        ceilings = torch.empty(len(states), filled.shape[1], dtype=filled.dtype)
        ceilings[missing] = filled
        present = [i for i in range(len(states)) if i not in set(missing)]
        if present:
            assert ready is not None
            ceilings[present] = ready[[at[seq_ids[i]] for i in present]]
        return ceilings

    @staticmethod
    def _grammar_state(group: SequenceGroup, seq: Sequence) -> GrammarState:
        """``seq``'s place in its request's grammar, started at its first sample (each of ``n`` samples gets
        its own). A request dispatched again after a failover carries the tokens already sampled at the end of
        its prompt (``seed_offset`` of them): the grammar starts past them, where the reply is."""
        if seq.grammar is None:
            assert group.grammar is not None
            seq.grammar = GrammarState(group.grammar)
            done = group.sampling_params.seed_offset
            for token in seq.prompt_token_ids[len(seq.prompt_token_ids) - done:] if done else ():
                seq.grammar.accept(token)
        return seq.grammar

    def _postprocess(self, rows: list[tuple[int, SequenceGroup, Sequence]], result: SamplerOutput
                     ) -> list[RequestDelta]:
        """The one step after sampling: each sequence takes its token, is detokenized and checked for a stop
        or its length limit; finished sequences free their blocks; one delta per sequence."""
        now = time.monotonic()
        deltas = []
        searches: dict[str, SequenceGroup] = {}
        candidates = result.beam_candidates or [None] * len(rows)
        for (_, group, seq), token, logprobs, cands in zip(rows, result.token_ids, result.logprobs, candidates,
                                                           strict=True):
            if group.first_token_time is None:
                group.first_token_time = now
            if group.beam is not None and cands is not None:
                group.beam.pending[seq.seq_id] = cands
                searches[group.request_id] = group
                continue
            deltas.append(self._append_token(group, seq, token, logprobs))
        for group in searches.values():
            deltas.extend(self._beam_step(group))
        return deltas

    # -- beam search ------------------------------------------------------------------------------
    def _beam_step(self, group: SequenceGroup) -> list[RequestDelta]:
        """Once every running beam of the group has sampled, let ``engine.beam`` pick the continuations and
        make them sequences: a parent extended once takes the token itself, each further continuation of it
        is a fork sharing its blocks, and a parent extended by none is dropped with its private blocks. A
        beam search streams nothing until it is done; then its ``n`` best beams finish whole."""
        search = group.beam
        assert search is not None
        beams = list(group.seqs)
        if any(seq.seq_id not in search.pending for seq in beams):
            return []  # a beam still prefilling (chunked, or recomputed after preemption) samples later
        params = group.sampling_params
        limit = min(self.max_model_len - group.num_prompt_tokens, params.max_tokens or self.max_model_len)
        chosen = search.step([search.pending[seq.seq_id] for seq in beams], [seq.output_token_ids for seq in beams],
                             end_tokens(self.eos_token_ids, params.stop_token_ids, params.ignore_eos), limit)
        extended: set[int] = set()
        next_beams: list[Sequence] = []
        for c in chosen:  # every fork before any token is appended: a child copies its parent's tokens
            parent = beams[c.parent]
            next_beams.append(parent if c.parent not in extended else self.scheduler.fork_seq(group, parent))
            extended.add(c.parent)
        for i, seq in enumerate(beams):
            if i not in extended:
                self.scheduler.drop_seq(group, seq)
                self._forget_seq(seq)
        for seq, c in zip(next_beams, chosen, strict=True):
            seq.token_ids.append(c.token)
        group.seqs = next_beams  # best first, as the search's scores are
        if not search.done:
            return []
        self.scheduler.finish_group(group)
        return self._finish_request(group)

    def _beam_results(self, group: SequenceGroup) -> list[Sequence]:
        """The group's ``n`` best hypotheses as finished sequences (they hold no blocks). Running beams fill
        in for a search cut short, with the reason it ended."""
        search = group.beam
        assert search is not None
        params = group.sampling_params
        running = list(group.seqs)
        hyps = search.best(params.n, [seq.output_token_ids for seq in running])
        cut_reason = next((s.finish_reason for s in running if s.finish_reason), "length")
        results = []
        for i, hyp in enumerate(hyps):
            seq = Sequence(group.prompt_token_ids + list(hyp.token_ids), group.num_prompt_tokens, index=i,
                           cache_salt=group.cache_salt)
            detok = self._detokenizer(seq, params)
            step = detok.step(list(hyp.token_ids))
            if not step.stopped:
                detok.flush()
            seq.output_text = detok.output_text
            if hyp.ended:
                seq.finish_reason = "stop"
                if hyp.token_ids[-1] not in self.eos_token_ids:
                    seq.stop_reason = hyp.token_ids[-1]
            else:
                seq.finish_reason = "length" if search.done else cut_reason
            seq.num_computed_tokens = seq.num_tokens
            results.append(seq)
        return results

    def _generator(self, group: SequenceGroup, seq: Sequence) -> torch.Generator | None:
        if seq.seq_id not in self._generators:
            params = group.sampling_params
            self._generators[seq.seq_id] = make_generator(params.seed, seq.index, skip=params.seed_offset)
        return self._generators[seq.seq_id]

    def _append_token(self, group: SequenceGroup, seq: Sequence, token: int,
                      logprobs: dict[int, float] | None) -> RequestDelta:
        params = group.sampling_params
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        grammar = seq.grammar
        if grammar is not None and not grammar.accept(token):
            log.error("request %s sampled token %d outside its grammar: %s", group.request_id, token,
                      grammar.error)
        detok = self._detok.get(seq.seq_id)
        if detok is None:
            detok = self._detok[seq.seq_id] = self._detokenizer(seq, params)
        step = detok.step([token])
        text = step.text_delta
        reason: str | None = None
        if step.stopped:  # a stop string, EOS (unless ignore_eos) or one of stop_token_ids
            reason = "stop"
            if step.stop_str is not None:
                seq.stop_reason = step.stop_str
            elif step.stop_token_id not in self.eos_token_ids:
                seq.stop_reason = step.stop_token_id
        elif grammar is not None and grammar.terminated:
            # The output is complete (only EOS may follow): it stops here, without a step to sample that EOS.
            # A state in error ends too, but not as "stop": "stop" promises output that follows the grammar.
            reason = "abort" if grammar.error else "stop"
            text += detok.flush()
        elif (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens
              or seq.num_tokens >= self.max_model_len):
            reason = "length"
            text += detok.flush()
        seq.output_text = detok.output_text
        delta = _delta(group, seq, text, [token], reason, [logprobs] if logprobs is not None else None)
        if reason is None:
            return delta
        self.scheduler.finish_seq(group, seq, reason)
        self._forget_seq(seq)
        if group.status is RequestStatus.FINISHED:
            delta.request_finished = True
            group.finished_time = time.monotonic()
            self._groups.pop(group.request_id, None)
        return delta

    def _detokenizer(self, seq: Sequence, params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params, self.eos_token_ids)

    def _forget_seq(self, seq: Sequence) -> None:
        self.runner.free_seq(seq.seq_id)
        self._detok.pop(seq.seq_id, None)
        self._generators.pop(seq.seq_id, None)

    def _finish_request(self, group: SequenceGroup) -> list[RequestDelta]:
        """Final deltas for a request ended by the engine (abort, or it can never fit), or a beam search that
        is done: it sent nothing before, so its deltas carry each returned beam whole."""
        self._groups.pop(group.request_id, None)
        group.finished_time = time.monotonic()
        for seq in group.seqs:
            self._forget_seq(seq)
        whole = group.beam is not None
        if whole:
            group.seqs = self._beam_results(group)
        deltas = [_delta(group, seq, seq.output_text if whole else "",
                         list(seq.output_token_ids) if whole else [], seq.finish_reason or "abort")
                  for seq in group.seqs]
        deltas[-1].request_finished = True
        return deltas

    # -- prefixes, numbers ------------------------------------------------------------------------
    def pin_prefix(self, key: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """Pin the cached full blocks of a prefix (compute it first, e.g. with a max_tokens=1 request with the
        same ``cache_salt``)."""
        salt = CacheSalt(cache_salt.encode()) if cache_salt else CacheSalt()
        return self.block_manager.pin(key, list(prompt_token_ids), salt)

    def block_size_tokens_min(self) -> int:
        """Shortest prefix that fills a block, and so the shortest worth computing to pin."""
        return self.block_manager.block_size

    def unpin_prefix(self, key: str) -> None:
        self.block_manager.unpin(key)

    def warm_prefix(self, key: str, history_token_ids: list[int], cache_salt: str | None = None,
                    shared_prefix_tokens: int = 0) -> int:
        """Bring a conversation's history up the KV tiers before its next message (best effort, bounded:
        engine.kv_tiers ``warm``); the blocks it loaded or started reading. Called between steps (the core
        applies commands there): the host to device copies run now, the disk reads on the disk tier's
        reader thread, installed by the steps that follow."""
        if self.tiers is None or self.tier_io is None:
            return 0
        salt = CacheSalt(cache_salt.encode(), shared_prefix_tokens) if cache_salt else CacheSalt()
        plan = self.tiers.warm(key, self.block_manager.history_chain(list(history_token_ids), salt))
        self.tier_io.spill(plan.spill)  # before the offloads overwrite those host blocks, as in a step
        self.runner.execute_block_plans(SchedulerOutput(tiers=plan))
        return len(plan.load) + len(self.tiers.warm_reads(key))

    def stats(self) -> EngineStats:
        """Counters only: cheap enough to publish after every step."""
        costs = self.scheduler.costs
        threads = None if self.threads is None else self.threads.switches
        stats = dataclasses.replace(
            self.scheduler.stats(), swap_seconds_per_block=costs.swap_seconds_per_block,
            prefill_seconds_per_token=costs.prefill_seconds_per_token,
            step_threads=None if threads is None else torch.get_num_threads(), step_thread_switches=threads)
        return stats if self.tiers is None else self.tiers.stats(stats, self.block_bytes)

    def kv_slot_usage(self) -> tuple[int, int]:
        """(device slots holding a token, slots allocated); walks every table, so benchmarks only."""
        return self.block_manager.slot_usage()

    def kv_snapshot(self) -> KVSnapshot:
        pool = self.block_manager.device
        pinned = {b for blocks in self.block_manager.pinned_blocks().values() for b in blocks}
        state = ["pinned" if b.block_id in pinned else "shared" if b.ref_count > 1
                 else "used" if b.ref_count == 1 else "cached" if b.block_hash is not None else "free"
                 for b in pool.blocks]
        requests = {group.request_id: list(dict.fromkeys(b for seq in group.seqs
                                                         for b in self.block_manager.block_table(seq)))
                    for group in self.scheduler.running}
        return KVSnapshot(
            block_size=self.block_manager.block_size, num_blocks=pool.num_blocks, state=state,
            refcounts=[b.ref_count for b in pool.blocks],
            cpu_used=self.block_manager.cpu.num_blocks - self.block_manager.cpu.num_free,
            requests=requests, pins=self.block_manager.pinned_blocks())

    # -- output helpers ---------------------------------------------------------------------------
    @staticmethod
    def request_output(group: SequenceGroup) -> RequestOutput:
        outputs = [CompletionOutput(seq.index, seq.output_text, list(seq.output_token_ids), seq.finish_reason,
                                    list(seq.output_logprobs) or None, seq.stop_reason)
                   for seq in sorted(group.seqs, key=lambda s: s.index)]
        times = {"arrival_time": group.arrival_time, "first_token_time": group.first_token_time,
                 "finished_time": group.finished_time}
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs,
                             group.is_finished, group.num_cached_tokens,
                             {k: t for k, t in times.items() if t is not None})


def _delta(group: SequenceGroup, seq: Sequence, text: str, token_ids: list[int], finish_reason: str | None,
           logprobs: list[dict[int, float]] | None = None) -> RequestDelta:
    """A delta of ``seq`` (finished when it has a ``finish_reason``) with the request's token counts."""
    return RequestDelta(
        request_id=group.request_id, index=seq.index, text=text, token_ids=token_ids,
        finished=finish_reason is not None, finish_reason=finish_reason, logprobs=logprobs,
        prompt_tokens=group.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
        cached_tokens=group.num_cached_tokens, stop_reason=seq.stop_reason)


__all__ = ["LLMEngine", "RequestOutput", "CompletionOutput"]
