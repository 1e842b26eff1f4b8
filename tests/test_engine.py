"""LLMEngine on a tiny random model: sharing, preemption, seeds, stops, aborts, bad input; on the real model,
that the first structured-output request does not stall the steps of running ones."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from timing import scaled
from tiny_model import make_tiny_model_dir

from engine.engine import LLMEngine
from engine.grammar import GrammarError, GrammarSpec
from engine.llm import LLM
from engine.request import SamplingParams


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"), arch="llama")


def _llm(tiny_dir: Path, **kw: object) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("dtype", "float32")
    return LLM(model=str(tiny_dir), **kw)  # type: ignore[arg-type]


PROMPTS = [
    "Hello! How are you today?",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "what is the capital of France?",
    "user assistant system",
    "0123456789 " * 5,
]


def _hf_greedy(tiny_dir: Path, ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers_batched_and_alone(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    alone = [llm.generate([p], params)[0] for p in PROMPTS]
    for p, b, a in zip(PROMPTS, batched, alone, strict=True):
        ids = llm.tokenizer.encode(p)
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].token_ids == _hf_greedy(tiny_dir, ids, 12)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_greedy_output(tiny_dir: Path, mode: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = _llm(tiny_dir).generate(PROMPTS, params)
    small = _llm(tiny_dir, num_kv_blocks=32, max_model_len=128, preemption_mode=mode, max_num_batched_tokens=64)
    outs = small.generate(PROMPTS, params)
    stats = small.stats()
    assert getattr(stats, f"preemptions_{mode}") > 0, stats
    for r, o in zip(reference, outs, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    assert stats.kv_blocks_free == stats.kv_blocks_total
    assert stats.cpu_blocks_free == stats.cpu_blocks_total


def test_prefix_caching_on_and_off_agree_and_second_run_hits(tiny_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    off = _llm(tiny_dir, enable_prefix_caching=False).generate(PROMPTS, params)
    llm = _llm(tiny_dir)
    first = llm.generate(PROMPTS, params)
    before = llm.stats().prefix_cache_hit_tokens
    second = llm.generate(PROMPTS, params)
    hits = llm.stats().prefix_cache_hit_tokens - before
    full_blocks = sum((len(llm.tokenizer.encode(p)) - 1) // 4 * 4 for p in PROMPTS)
    assert hits == full_blocks
    for a, b, c in zip(off, first, second, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_n_samples_share_prompt_blocks(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir)
    eng = llm.engine
    prompt = "The quick brown fox jumps over the lazy dog. " * 2
    group = eng.add_request("n3", SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=1), prompt=prompt)
    eng.step()  # prefill, fork into 3, first token each
    assert len(group.seqs) == 3
    tables = [eng.block_manager.block_table(s) for s in group.seqs]
    num_prompt_full = group.num_prompt_tokens // 4
    for t in tables[1:]:
        assert t[:num_prompt_full] == tables[0][:num_prompt_full]
    for b in tables[0][:num_prompt_full]:
        assert eng.block_manager.device.blocks[b].ref_count == 3
    used = eng.stats().kv_blocks_total - eng.stats().kv_blocks_free
    separate = 3 * len(tables[0])
    assert used < separate
    filled, allocated = eng.kv_slot_usage()
    assert allocated == used * 4 and 0 < filled <= allocated
    while eng.has_unfinished():
        eng.step()
    out = LLMEngine.request_output(group)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 6 or o.finish_reason == "stop" for o in out.outputs)
    assert eng.stats().kv_blocks_free == eng.stats().kv_blocks_total


def test_seed_reproduces_regardless_of_batch(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir)
    seeded = SamplingParams(temperature=1.0, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    mixed = llm.generate(PROMPTS, [seeded] + [SamplingParams(temperature=1.0, max_tokens=10)] * 4)
    assert mixed[0].outputs[0].token_ids == alone
    other = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=10, seed=99, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_stop_string_is_honoured(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir)
    free = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    stopped = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop],
                                                        ignore_eos=True))[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert stop not in stopped.text
    assert text.startswith(stopped.text)


def test_abort_frees_every_block(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"a{i}", SamplingParams(n=2, max_tokens=50), prompt=p)
    for _ in range(3):
        eng.step()
    assert eng.stats().kv_blocks_free < eng.stats().kv_blocks_total
    for i in range(len(PROMPTS)):
        deltas = eng.abort_request(f"a{i}")
        assert deltas and all(d.finish_reason == "abort" for d in deltas)
        assert deltas[-1].request_finished
    assert not eng.has_unfinished()
    eng.block_manager.check_invariants()
    assert eng.stats().kv_blocks_free == eng.stats().kv_blocks_total


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"reserve_output_tokens": 0}, "reserve_output_tokens"),
        ({"max_tokens": 4, "reserve_output_tokens": 5}, "reserve_output_tokens"),
        ({"reserve_output_tokens": 2.5}, "reserve_output_tokens"),
    ],
)
def test_bad_sampling_params_raise_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_bad_requests_change_nothing(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir, max_model_len=64)
    eng = llm.engine
    before = eng.stats()
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok", "word " * 200], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]], sampling_params=SamplingParams())
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompt_token_ids=[[10**9]], sampling_params=SamplingParams())
    assert eng.stats() == before
    assert not eng.has_unfinished()


def test_unknown_model_and_corrupt_gguf(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        LLM(model=str(tmp_path / "nope"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError):
        LLM(model=str(bad))


def test_triton_backend_matches_torch_in_interpreter(tiny_dir: Path) -> None:
    """The Triton kernels (run by the interpreter on CPU; conftest sets TRITON_INTERPRET=1) drive the
    engine to the same greedy tokens as the torch reference, through chunked prefill and a shared prefix."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[1] + " again", PROMPTS[0]]
    kw = {"block_size": 8, "num_kv_blocks": 64, "max_num_batched_tokens": 32}
    torch_out = _llm(tiny_dir, attention_backend="torch", **kw).generate(prompts, params)
    triton_out = _llm(tiny_dir, attention_backend="triton", **kw).generate(prompts, params)
    for a, b in zip(torch_out, triton_out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_cpu_backend_matches_torch(tiny_dir: Path) -> None:
    """The C++ decode kernel drives the engine to the same greedy tokens as the torch reference,
    through chunked prefill, a shared prefix and preemption."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = {"num_kv_blocks": 24, "max_num_batched_tokens": 32, "max_model_len": 96}
    torch_out = _llm(tiny_dir, attention_backend="torch", **kw).generate(PROMPTS, params)
    llm = _llm(tiny_dir, attention_backend="cpu", **kw)
    assert llm.engine.runner.backend.name == "cpu"
    cpu_out = llm.generate(PROMPTS, params)
    stats = llm.stats()
    assert stats.preemptions_swap + stats.preemptions_recompute > 0
    for a, b in zip(torch_out, cpu_out, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


# -- structured outputs (engine.grammar) ------------------------------------------------------------------
ITEM = {"type": "object", "required": ["color", "n", "name"],
        "properties": {"color": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                       "name": {"type": "string", "maxLength": 12}}}


def _valid_item(text: str) -> None:
    item = json.loads(text)
    assert set(item) == {"color", "n", "name"}, item  # no junk keys: strict objects are closed
    assert item["color"] in ("red", "green") and 0 <= item["n"] <= 9 and len(item["name"]) <= 12


def test_grammar_rows_batch_with_plain_rows_that_stay_unchanged(tiny_dir: Path) -> None:
    """A random model still writes JSON of the schema under the grammar, each of n samples its own, ending
    with "stop" as soon as the object closes; the plain rows batched with them get the tokens they get
    alone."""
    llm = _llm(tiny_dir)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = GrammarSpec.json_schema(ITEM)
    alone = llm.generate(PROMPTS, plain)
    params = [SamplingParams(temperature=0.0, max_tokens=64, grammar=spec) if i % 2 else plain
              for i in range(len(PROMPTS))]
    params[0] = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=64, grammar=spec)
    mixed = llm.generate(PROMPTS, params)
    for i, (a, m) in enumerate(zip(alone, mixed, strict=True)):
        if params[i].grammar is None:
            assert m.outputs[0].token_ids == a.outputs[0].token_ids
            continue
        assert len(m.outputs) == params[i].n
        for out in m.outputs:
            assert out.finish_reason == "stop" and out.stop_reason is None
            _valid_item(out.text)
    assert len({o.text for o in mixed[0].outputs}) > 1  # the samples went their own ways
    assert llm.stats().kv_blocks_free == llm.stats().kv_blocks_total


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_grammar_output(tiny_dir: Path, mode: str) -> None:
    """The grammar state follows accepted tokens only: a sequence preempted mid-object (its KV swapped out, or
    dropped and prefilled again) goes on with the same tokens as one never preempted."""
    spec = GrammarSpec.json_schema(ITEM)
    # Grammar rows on the short prompts: the long one and a reply of ~50 tokens would not fit max_model_len.
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.0, max_tokens=64, grammar=spec) for i in range(len(PROMPTS))]
    reference = _llm(tiny_dir).generate(PROMPTS, params)
    small = _llm(tiny_dir, num_kv_blocks=32, max_model_len=128, preemption_mode=mode, max_num_batched_tokens=64)
    outs = small.generate(PROMPTS, params)
    assert getattr(small.stats(), f"preemptions_{mode}") > 0
    for p, r, o in zip(params, reference, outs, strict=True):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        if p.grammar is not None:
            _valid_item(o.outputs[0].text)


def test_grammar_resumes_after_the_tokens_a_failover_carries(tiny_dir: Path) -> None:
    """A request dispatched again carries its sampled tokens in the prompt (``seed_offset`` of them): the
    grammar starts past them, so the rest of the reply is what an uninterrupted run wrote."""
    llm = _llm(tiny_dir)
    spec = GrammarSpec.json_schema(ITEM)
    ids = llm.tokenizer.encode(PROMPTS[2])
    whole = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=64, grammar=spec))[0].outputs[0].token_ids
    done = len(whole) // 2
    rest = llm.generate(prompt_token_ids=[ids + whole[:done]], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=64, grammar=spec, seed_offset=done))[0].outputs[0]
    assert whole[:done] + rest.token_ids == whole and rest.finish_reason == "stop"


def test_bad_grammar_requests_are_refused_before_queueing(tiny_dir: Path) -> None:
    llm = _llm(tiny_dir)
    eng = llm.engine
    with pytest.raises(GrammarError, match="schema"):
        eng.add_request("bad", SamplingParams(grammar=GrammarSpec.json_schema({"type": "object", "minProperties":
                                                                               "x"})), prompt="hi")
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, best_of=2, n=1, temperature=0.0, grammar=GrammarSpec.json_object())
    assert not eng.has_unfinished()
    out = llm.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=40,
                                              grammar=GrammarSpec.json_object()))[0].outputs[0]
    assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict)


@pytest.mark.integration
def test_first_grammar_request_does_not_stall_running_steps() -> None:
    """llguidance's tokenizer index (about a second for the real model's 49k vocabulary, the GIL held) is
    built while the engine starts: the first grammar request, arriving while another request decodes, is
    taken in at once (its schema's compile is milliseconds) and the steps after it take what steps took
    before it, where building the index then stalled the step loop for that second."""
    from gateway_fixtures import default_model_path

    # One thread: a step's time then varies less with what else runs on a shared machine.
    eng = LLMEngine.from_args(default_model_path(), dtype="float32", attention_backend="torch", num_kv_blocks=128,
                              engine_threads=1)
    eng.add_request("plain", SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True),
                    prompt="Tell me a long story about a lighthouse.")
    for _ in range(3):  # the prompt and the first decodes: kernels and caches warm
        eng.step()
    before = []
    for _ in range(6):
        started = time.perf_counter()
        eng.step()
        before.append(time.perf_counter() - started)
    started = time.perf_counter()
    eng.add_request("json", SamplingParams(temperature=0.0, max_tokens=60, grammar=GrammarSpec.json_schema(ITEM)),
                    prompt="A JSON item with a color, a small number and a name:")
    add_s = time.perf_counter() - started
    after: list[float] = []
    texts: dict[str, str] = {}
    finished = False
    while not finished and len(after) < 100:
        started = time.perf_counter()
        for delta in eng.step():
            texts[delta.request_id] = texts.get(delta.request_id, "") + delta.text
            finished |= delta.request_id == "json" and delta.request_finished
        after.append(time.perf_counter() - started)
    assert add_s < scaled(0.25), add_s
    # Two rows instead of one, the first of them a prefill, and the masks: a bounded multiple of a step.
    assert max(after) < 3 * max(before) + scaled(0.1), (before, after)
    item = json.loads(texts["json"])
    assert set(item) == {"color", "n", "name"}, item
