"""xgrammar vs llguidance for structured outputs (issue 36), measured on the project's tokenizer.

Both libraries take a JSON schema, follow the tokens a model emits and fill a bitmask of the tokens allowed
next. What decides between them here, each measured on SmolLM2-135M-Instruct's 49,152-token vocabulary:
  * tokenizer setup: building each library's view of the vocabulary (once per engine);
  * compile: a schema to a first mask (compile + matcher + first fill), median of ``--repeats``, with the
    library's cache off, for three schemas: a small object, a nested one with arrays and enums, and the
    tool-call union of three functions that ``engine.grammar.tool_call_schema`` builds;
  * mask fill: per-step time of one row during ``--walks`` walks per schema (each step picks the best allowed
    token under random logits: every grammar state a model could reach gets visited, not only the likely
    ones) and of a 32-row batch in lockstep through each library's own parallel filler;
  * correctness: every finished walk decodes (our tokenizer) to text that ``json.loads`` and validates;
  * pathological schemas: each compiled in a child process killed after ``--limit`` seconds; "error" is what
    a server wants (a 400), "timeout" a stalled compile;
  * footprint: each package's installed size and what it requires (torch must stay the CPU build we pin).

xgrammar is not a dependency of the project: ``pip install xgrammar==0.2.8`` first (an engine that is not
installed is skipped, and the record says so).
Usage: python benchmarks/grammar_engines.py [--walks 12] [--repeats 3] [--limit 20] [--output FILE]
Last line: one JSON object {"engines": {name: {...}}, "choice", "why", "cpu", "isa", "cores", "commit",
"torch", "load_before", "load_after"}.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import machine  # noqa: E402
import torch  # noqa: E402

SMALL: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "age"],
    "properties": {"name": {"type": "string", "maxLength": 16},
                   "age": {"type": "integer", "minimum": 0, "maximum": 130}}}
NESTED: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["title", "status", "tags", "author", "sections"],
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "status": {"enum": ["draft", "review", "published"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "rating": {"type": "number"},
        "author": {"type": "object", "additionalProperties": False, "required": ["name", "verified"],
                   "properties": {"name": {"type": "string", "maxLength": 16},
                                  "email": {"type": "string", "maxLength": 24},
                                  "verified": {"type": "boolean"}}},
        "sections": {"type": "array", "minItems": 1, "maxItems": 3,
                     "items": {"type": "object", "additionalProperties": False,
                               "required": ["heading", "level"],
                               "properties": {"heading": {"type": "string", "maxLength": 16},
                                              "level": {"type": "integer", "minimum": 1, "maximum": 6}}}}}}
# OpenAI-shaped tools; string lengths are bounded only so that random walks end (a model's strings end on
# their own).
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 20},
                       "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web", "parameters": {
        "type": "object", "required": ["query"],
        "properties": {"query": {"type": "string", "maxLength": 30},
                       "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}}}},
    {"type": "function", "function": {"name": "send_email", "description": "Send an email", "parameters": {
        "type": "object", "required": ["to", "subject"],
        "properties": {"to": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
                       "subject": {"type": "string", "maxLength": 20},
                       "urgent": {"type": "boolean"}}}}},
]


def tool_union(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The schema of one tool call, ``{"name": <one of the tools>, "arguments": <its parameters>}``: what
    ``engine.grammar.tool_call_schema`` builds (written out here so that the measurement stays as it was)."""
    return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": t["function"]["name"]},
                                      "arguments": t["function"]["parameters"]}} for t in tools]}


SCHEMAS = {"small": SMALL, "nested": NESTED, "tools3": tool_union(TOOLS)}
# Schemas a client could send to stall a compile or a mask: regexes whose DFA explodes, long repetitions,
# deep nesting, huge enums.
PATHOLOGICAL: dict[str, dict[str, Any]] = {
    "regex_dfa_blowup": {"type": "string", "pattern": "^[ab]*a[ab]{30}$"},
    "long_repeat": {"type": "array", "items": {"type": "string"}, "minItems": 4000, "maxItems": 8000},
    "string_length": {"type": "string", "minLength": 20000, "maxLength": 40000},
    "deep_nesting": {},  # built below
    "huge_enum": {"enum": [f"value-{i:05d}-{i * 7919 % 100003}" for i in range(30000)]},
}
_deep: dict[str, Any] = {"type": "integer"}
for _ in range(300):
    _deep = {"type": "object", "properties": {"a": _deep}, "required": ["a"], "additionalProperties": False}
PATHOLOGICAL["deep_nesting"] = _deep

# ---------------------------------------------------------------------------------------------- engines


class Engine:
    """One library behind the few calls the measurements need."""

    name = ""
    package = ""

    @staticmethod
    def load() -> None:
        """Imports the library (untimed: xgrammar's import is torch's, llguidance.torch's torch.compile's)."""

    def __init__(self, hf: Any, vocab: int, stop: list[int], threads: int) -> None:
        raise NotImplementedError

    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, m: Any, token: int) -> bool: ...


class XGrammar(Engine):
    name, package = "xgrammar", "xgrammar"

    @staticmethod
    def load() -> None:
        import xgrammar  # noqa: F401

    def __init__(self, hf: Any, vocab: int, stop: list[int], threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=stop)
        # The cache off, so that every compile is measured; a server keeps it on (or caches itself).
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                 separators=(", ", ": "))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))


class LLGuidance(Engine):
    name, package = "llguidance", "llguidance"

    @staticmethod
    def load() -> None:
        import llguidance.hf  # noqa: F401

    def __init__(self, hf: Any, vocab: int, stop: list[int], threads: int) -> None:
        import llguidance
        import llguidance.hf

        # Its raw pointer calls, as engine/grammar.py makes them: llguidance.torch imports torch.compile.
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=stop)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_flexible": False, "item_separator": ", ",
                                           "key_separator": ": "})
        error = self.llg.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        size = bitmask.shape[1] * 4
        m.unsafe_compute_mask_ptr(bitmask.data_ptr() + row * size, size)

    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(ms)]
        words, rows = bitmask.shape[1], bitmask.shape[0]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, rows)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.consume_token(token))


ENGINES: dict[str, type[Engine]] = {"xgrammar": XGrammar, "llguidance": LLGuidance}

# ---------------------------------------------------------------------------------------------- measuring


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, words]`` int32 bits -> ``[rows, vocab]`` bool (bit j of word w is token 32 * w + j)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]


def validate(value: Any, schema: dict[str, Any]) -> bool:
    """The subset of JSON Schema these schemas use (jsonschema is no dependency of the project)."""
    if "anyOf" in schema:
        return any(validate(value, s) for s in schema["anyOf"])
    if "const" in schema:
        return bool(value == schema["const"])
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
                and all(validate(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list)
                and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
                and all(validate(v, schema.get("items", {})) for v in value))
    if kind == "string":
        return (isinstance(value, str)
                and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -(1 << 62)) <= value <= schema.get("maximum", 1 << 62))
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    return True


def walk(engine: Engine, compiled: Any, gen: torch.Generator, vocab: int, stop: set[int],
         max_steps: int = 600) -> tuple[list[int], list[float], bool]:
    """One constrained generation: each step the best allowed token under fresh random logits."""
    m = engine.matcher(compiled)
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    tokens: list[int] = []
    fills: list[float] = []
    for _ in range(max_steps):
        start = time.perf_counter()
        engine.fill(m, bitmask, 0)
        fills.append(time.perf_counter() - start)
        logits = torch.randn(1, vocab, generator=gen)
        logits.masked_fill_(~unpack(bitmask, vocab), float("-inf"))
        token = int(logits.argmax())
        if not engine.accept(m, token):
            raise AssertionError(f"{engine.name} refused token {token} its own mask allowed")
        if token in stop:
            return tokens, fills, True
        tokens.append(token)
    return tokens, fills, False


def batch_fill_ms(engine: Engine, compiled: list[Any], vocab: int, stop: set[int], rows: int = 32,
                  steps: int = 60) -> float:
    """Median time of one mask fill of ``rows`` rows advancing together (a finished row restarts)."""
    gen = torch.Generator().manual_seed(1)
    ms = [engine.matcher(compiled[i % len(compiled)]) for i in range(rows)]
    bitmask = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.fill_batch(ms, bitmask)
        times.append(time.perf_counter() - start)
        logits = torch.randn(rows, vocab, generator=gen)
        logits.masked_fill_(~unpack(bitmask, vocab), float("-inf"))
        for i, token in enumerate(logits.argmax(dim=-1).tolist()):
            engine.accept(ms[i], token)
            if token in stop:
                ms[i] = engine.matcher(compiled[i % len(compiled)])
    return statistics.median(times) * 1e3


def _setup(name: str, threads: int) -> tuple[Engine, Any, int, list[int], float]:
    from engine.model_files import load_tokenizer

    tok, config = load_tokenizer()
    stop = sorted(tok.eos_token_ids)
    ENGINES[name].load()
    start = time.perf_counter()
    engine = ENGINES[name](tok.hf, config.vocab_size, stop, threads)
    return engine, tok, config.vocab_size, stop, time.perf_counter() - start


def _pathological_child(name: str, case: str, threads: int, out: Any) -> None:
    engine, _, vocab, _, _ = _setup(name, threads)
    schema = PATHOLOGICAL[case]  # by name: the deep one is too deep to pickle
    out.put("ready")  # the parent's clock starts here, not at this process's imports and tokenizer
    start = time.perf_counter()
    try:
        m = engine.matcher(engine.compile(schema))
        engine.fill(m, torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32), 0)
        result = "ok"
    except Exception as e:  # what the library raises is the finding
        result = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    out.put((result, round((time.perf_counter() - start) * 1e3, 1)))


def pathological(name: str, threads: int, limit: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    results: dict[str, Any] = {}
    for case in PATHOLOGICAL:
        out = ctx.Queue()
        child = ctx.Process(target=_pathological_child, args=(name, case, threads, out))
        child.start()
        try:
            out.get(timeout=300)
            result, ms = out.get(timeout=limit)
            results[case] = {"result": result, "ms": ms}
        except Exception:
            results[case] = {"result": f"timeout (> {limit:.0f} s, killed)", "ms": None}
        child.kill()
        child.join()
    return results


def footprint(package: str) -> dict[str, Any]:
    dist = md.distribution(package)
    size = sum((f.size or 0) for f in dist.files or [])
    # What installing it pulls in (its extras' test and platform requirements are not).
    requires = [r.split(";")[0].strip() for r in dist.requires or [] if "extra ==" not in r]
    return {"version": dist.version, "installed_mb": round(size / 2**20, 1), "requires": requires}


def measure(name: str, walks: int, repeats: int, threads: int, limit: float) -> dict[str, Any]:
    engine, tok, vocab, stop, setup_s = _setup(name, threads)
    stop_set = set(stop)
    compile_ms: dict[str, float] = {}
    compiled: dict[str, Any] = {}
    for key, schema in SCHEMAS.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            compiled[key] = engine.compile(schema)
            first = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
            engine.fill(engine.matcher(compiled[key]), first, 0)
            times.append(time.perf_counter() - start)
        compile_ms[key] = round(statistics.median(times) * 1e3, 2)
    gen = torch.Generator().manual_seed(0)
    fills: list[float] = []
    valid = finished = total = 0
    failures: list[str] = []
    for key, schema in SCHEMAS.items():
        for _ in range(walks):
            tokens, times, done = walk(engine, compiled[key], gen, vocab, stop_set)
            fills += times
            total += 1
            if not done:
                continue
            finished += 1
            text = tok.decode(tokens)
            try:
                ok = validate(json.loads(text), schema)
            except json.JSONDecodeError:
                ok = False
            valid += ok
            if not ok and len(failures) < 3:
                failures.append(f"{key}: {text[:200]!r}")
    fills.sort()
    result = {
        "footprint": footprint(engine.package),
        "tokenizer_setup_s": round(setup_s, 2),
        "compile_to_first_mask_ms": compile_ms,
        "fill_row_us": {"median": round(statistics.median(fills) * 1e6, 1),
                        "p99": round(fills[int(len(fills) * 0.99)] * 1e6, 1),
                        "max": round(fills[-1] * 1e6, 1), "steps": len(fills)},
        "fill_32_rows_ms": round(batch_fill_ms(engine, list(compiled.values()), vocab, stop_set), 3),
        "walks": {"total": total, "finished": finished, "valid": valid, "failures": failures},
        "pathological": pathological(name, threads, limit),
    }
    print(f"{name}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return result


def apply_ms(vocab: int, rows: int = 32) -> dict[str, float]:
    """Masking ``[rows, vocab]`` float32 logits in place from a bitmask: ``engine.grammar_masks.apply_bitmask``
    (a byte table to ceilings, then a minimum) vs xgrammar's C++ kernel where it is installed."""
    from engine.grammar_masks import apply_bitmask

    bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32)
    logits = torch.randn(rows, vocab)
    every = list(range(rows))
    cases: dict[str, Any] = {"engine.grammar_masks": lambda: apply_bitmask(logits, bitmask, every, vocab)}
    try:
        import xgrammar as xgr

        cases["xgrammar_cpu"] = lambda: xgr.apply_token_bitmask_inplace(logits, bitmask, backend="cpu")
    except ImportError:
        pass
    result: dict[str, float] = {}
    for key, fn in cases.items():
        times = []
        for _ in range(50):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result[key] = round(statistics.median(times) * 1e3, 3)
    return result


# What the record under benchmarks/results/grammar_engines/ showed on this project's 2-core CPU, and so what
# engine/grammar.py uses.
CHOICE = "llguidance"
WHY = ("compile to first mask in 1-20 ms (xgrammar: 0.25-1.4 s per schema, precomputing masks over the "
       "whole vocabulary); pathological schemas end as errors in milliseconds or compile in under a "
       "second (xgrammar: 12-14 s on deep nesting and a 30k enum, past 20 s in busier runs, in C++ that"
       " a server cannot stop); 32-row mask fills 1.3-2x faster; every finished walk valid for both on "
       "our tokenizer; and a wheel with no dependencies (xgrammar requires torch, transformers, triton,"
       " apache-tvm-ffi). xgrammar's edge: its C++ mask applier, about 3x faster than engine.grammar's "
       "numpy + torch one.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--walks", type=int, default=12, help="random walks per schema")
    parser.add_argument("--repeats", type=int, default=3, help="compiles per schema (median)")
    parser.add_argument("--limit", type=float, default=20.0, help="seconds a pathological compile may take")
    parser.add_argument("--engines", default="xgrammar,llguidance")
    parser.add_argument("--output", type=Path, default=None, help="also write the report to this file, "
                        "replacing it (a record: benchmarks/results/grammar_engines/"
                        "$(python benchmarks/machine.py)/record.txt)")
    args = parser.parse_args()
    host = machine.describe()
    load_before = machine.load_avg()
    machine.warn_if_busy("grammar_engines", load_before)
    threads = host.cores
    engines: dict[str, Any] = {}
    for name in args.engines.split(","):
        try:
            md.distribution(ENGINES[name].package)
        except md.PackageNotFoundError:
            engines[name] = {"skipped": f"not installed (pip install {name})"}
            continue
        engines[name] = measure(name, args.walks, args.repeats, threads, args.limit)
    vocab = 49152
    apply = apply_ms(vocab)
    final = {"engines": engines, "apply_32_rows_ms": apply, "choice": CHOICE, "why": WHY,
             "torch_after_installs": machine.torch_version(), "cpu": host.cpu, "isa": host.isa,
             "cores": host.cores, "commit": host.commit, "torch": host.torch, "threads": threads,
             "walks_per_schema": args.walks, "load_before": list(load_before),
             "load_after": list(machine.load_avg())}
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    load = " ".join(map(str, load_before))
    lines = [f"# {stamp}  commit {host.commit}  command: python benchmarks/grammar_engines.py "
             + " ".join(sys.argv[1:]), f"machine: {host.line()}; load avg at start {load}"]
    for name, e in engines.items():
        if "skipped" in e:
            lines.append(f"{name}: {e['skipped']}")
            continue
        fp = e["footprint"]
        lines += [f"{name} {fp['version']}: {fp['installed_mb']} MB installed, requires "
                  f"{', '.join(fp['requires']) or 'nothing'}",
                  f"  tokenizer setup {e['tokenizer_setup_s']} s; compile to first mask, ms: "
                  f"{e['compile_to_first_mask_ms']}",
                  f"  mask fill of one row, us: {e['fill_row_us']}; of 32 rows at once, ms: "
                  f"{e['fill_32_rows_ms']}",
                  f"  walks {e['walks']}",
                  *(f"  pathological {k}: {v['result']} in {v['ms']} ms"
                    for k, v in e["pathological"].items())]
    lines += [f"apply the mask to 32 x {vocab} float32 logits, ms: {apply}", f"choice: {CHOICE}: {WHY}",
              json.dumps(final)]
    machine.report(lines, args.output)


if __name__ == "__main__":
    main()
