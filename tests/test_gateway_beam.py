"""vLLM's beam search fields on the OpenAI routes: they reach the engine as beam search parameters, and a
combination the engine refuses is a 400 naming the field (uvicorn over the fake engine and a real Redis)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, engine_fixture, fake_gateway  # noqa: F401
from gateway_fixtures import LiveServer, redis_proc  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def server(redis_proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:  # noqa: F811
    with fake_gateway(redis_proc.url, tmp_path_factory.mktemp("tok"), max_model_len=256, max_n=4) as live:
        yield live


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def last_params(engine: FakeEngine) -> Any:
    return engine.submitted[list(engine.submitted)[-1]].params


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_beam_fields_reach_the_engine(server: LiveServer, engine: FakeEngine, path: str,
                                      body: dict[str, Any]) -> None:
    r = post(server, path, {**body, "use_beam_search": True, "best_of": 3, "n": 2, "length_penalty": 0.5,
                            "early_stopping": "never", "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    p = last_params(engine)
    assert (p.use_beam_search, p.best_of, p.n, p.length_penalty, p.early_stopping) == (True, 3, 2, 0.5, "never")
    post(server, path, {**body, "max_tokens": 8})
    assert not last_params(engine).use_beam_search


@pytest.mark.parametrize(("body", "param"), [
    ({"best_of": 3}, "best_of"),  # best_of > n only with beam search
    ({"use_beam_search": True, "best_of": 5}, "best_of"),  # over max_n
    ({"use_beam_search": True, "best_of": 2, "top_p": 0.5}, None),
    ({"use_beam_search": True, "best_of": 2, "n": 3}, None),
    ({"use_beam_search": True, "best_of": 2, "early_stopping": "maybe"}, None),
])
def test_refused_beam_requests(server: LiveServer, body: dict[str, Any], param: str | None) -> None:
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
