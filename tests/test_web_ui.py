"""The browser chat UI (web/) in Debian's Chromium, driven by Playwright, against a real
``chatsvc serve`` with the default model, a private redis-server and an API key.

One server and one browser serve the whole module; each test gets a fresh browser context. The
model's words are not predictable, so the tests check behaviour (text grows, stops, survives a
reload, matches what the server stored) rather than content.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.browser, pytest.mark.integration]

ROOT = Path(__file__).resolve().parent.parent
# Screenshots go to a test's temporary directory; to refresh the ones in docs/ on purpose, point this
# variable at docs/ (the page must then show what the README says it shows).
SCREENSHOT_DIR_ENV = "CHATSVC_SCREENSHOT_DIR"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
API_KEY = "ui-test-key"

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium); browsers are never downloaded",
                allow_module_level=True)
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    redis_port: int
    pid: int

    def api(self, method: str, path: str, **kw: Any) -> Any:
        r = httpx.request(method, self.url + path, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10, **kw)
        r.raise_for_status()
        return r.json()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chatsvc serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"chatsvc serve not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("webui")
    redis_port, port = free_port(), free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = tmp / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)  # the server runs the CPU path; the interpreter only slows it
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chatsvc.cli", "serve", "--port", str(port),
             "--redis-url", f"redis://127.0.0.1:{redis_port}/0", "--api-key", API_KEY,
             "--num-kv-blocks", "160", "--log-level", "warning"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log, timeout=120)
        yield Server(url, redis_port, proc.pid)
    finally:
        _stop(proc)
        _stop(redis)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


@dataclass
class Tab:
    page: Any
    context: Any
    problems: list[str]


@pytest.fixture
def open_tab(browser: Any, server: Server) -> Iterator[Callable[..., Tab]]:
    """Opens the UI in a fresh context; fails the test on page errors or requests leaving the server."""
    tabs: list[Tab] = []

    def open_(width: int = 1280, height: int = 800, key: bool = True) -> Tab:
        context = browser.new_context(viewport={"width": width, "height": height})
        if key:
            context.add_init_script(f"localStorage.setItem('chatsvc.apiKey', {json.dumps(API_KEY)})")
        page = context.new_page()
        page.set_default_timeout(20_000)
        tab = Tab(page, context, [])
        page.on("pageerror", lambda e: tab.problems.append(f"page error: {e}"))
        page.on("request", lambda r: None if r.url.startswith((server.url, "data:", "blob:"))
                else tab.problems.append(f"external request: {r.url}"))
        page.goto(server.url + "/")
        tabs.append(tab)
        return tab

    yield open_
    problems = [p for t in tabs for p in t.problems]
    for t in tabs:
        t.context.close()
    assert not problems, problems


def start_chat(page: Any, persona: str, max_tokens: int, temperature: float = 0.0) -> str:
    page.click(f"button.persona[data-persona='{persona}']")
    page.wait_for_selector("#conn[data-state='open']")
    page.click("#options summary")
    page.fill("#opt-max-tokens", str(max_tokens))
    page.fill("#opt-temperature", str(temperature))
    page.click("#options summary")
    return str(page.evaluate("window.chatsvc.state.sessionId"))


def send(page: Any, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def last_reply(page: Any) -> Any:
    return page.locator(".msg.assistant").last


def wait_reply_started(page: Any) -> None:
    page.wait_for_function(
        "() => { const m = [...document.querySelectorAll('.msg.assistant')].pop(); return m && m.dataset.text; }")


def wait_reply_done(page: Any, timeout: float = 60_000) -> str:
    page.wait_for_function(
        "() => { const m = [...document.querySelectorAll('.msg.assistant')].pop(); return m && m.dataset.finish; }",
        timeout=timeout)
    return str(last_reply(page).get_attribute("data-finish"))


@contextmanager
def engine_paused(server: Server) -> Iterator[None]:
    """SIGSTOP the server's engine process (its multiprocessing child) for the block: what the page does
    meanwhile cannot race the model, however fast the machine generates."""
    children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
    engines = [int(c) for c in children
               if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()
               and b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(engines) == 1, f"expected one engine process under {server.pid}, found {engines}"
    os.kill(engines[0], signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(engines[0], signal.SIGCONT)


def stored_messages(server: Server, sid: str) -> list[dict[str, Any]]:
    return list(server.api("GET", f"/v1/sessions/{sid}")["messages"])


def test_client_modules(open_tab: Callable[..., Tab]) -> None:
    """The page's helpers on inputs the live server rarely produces: stale or replayed event ids,
    each kind of error, Markdown cut off mid-stream."""
    page = open_tab().page
    out = page.evaluate("""async () => {
        const { isAfter } = await import('/socket.js');
        const { describeError } = await import('/api.js');
        const { renderMarkdown } = await import('/markdown.js');
        const div = document.createElement('div');
        div.append(renderMarkdown('intro\\n\\n3. x\\n4. y\\n\\n```js\\nlet a = "<b>";'));
        return {
            after: [isAfter('3:1700-5', '3:1700-4'), isAfter('3:1699-9', '3:1700-0'), isAfter('3:1700-4', '3:1700-4'),
                    isAfter('4:1-0', '3:1700-9'), isAfter('3:1700-9', '4:1-0')],
            errors: [describeError({status: 429, message: 'slow down'}), describeError({code: 'queue_full', message: 'x'}),
                     describeError({code: 'invalid_api_key', message: 'invalid API key'}),
                     describeError({status: 0, code: 'unreachable'}),
                     describeError({code: 'invalid_value', message: 'temperature: too high'})],
            html: div.innerHTML,
        };
    }""")
    assert out["after"] == [True, False, False, True, False]
    busy, queue, key, gone, invalid = out["errors"]
    assert "busy" in busy and "slow down" in busy and "busy" in queue
    assert "API key" in key and "Not authorized" in key
    assert "cannot be reached" in gone
    assert invalid == "Invalid request: temperature: too high"
    # the fence is still open (the reply is streaming): its text is code, escaped, not markup
    assert out["html"] == ('<p>intro</p><ol start="3"><li>x</li><li>y</li></ol>'
                           '<pre><code data-lang="js">let a = "&lt;b&gt;";</code></pre>')


def test_api_key_is_asked_once_and_kept(open_tab: Callable[..., Tab], server: Server) -> None:
    tab = open_tab(key=False)
    page = tab.page
    page.wait_for_selector("#key-dialog[open]")
    assert page.locator("button.persona").count() == 0  # the server refused to list them without a key
    page.fill("#key-input", API_KEY)
    page.click("#key-dialog button[value='save']")
    expected = server.api("GET", "/v1/personas")["data"]
    page.wait_for_selector("button.persona")
    cards = page.locator("button.persona")
    assert cards.count() == len(expected) > 0
    for p in expected:
        card = page.locator(f"button.persona[data-persona='{p['name']}']")
        assert p["description"] in card.inner_text()
    page.reload()
    page.wait_for_selector("button.persona")
    assert not page.locator("#key-dialog").evaluate("d => d.open")
    assert page.evaluate("localStorage.getItem('chatsvc.apiKey')") == API_KEY


def screenshot_dir(tmp_path: Path) -> Path:
    return Path(os.environ.get(SCREENSHOT_DIR_ENV) or tmp_path)


def test_reply_streams_then_history_survives_reload(open_tab: Callable[..., Tab], server: Server,
                                                    tmp_path: Path) -> None:
    page = open_tab().page
    sid = start_chat(page, "pirate", max_tokens=24)
    page.fill("#input", "Hello captain!")
    page.press("#input", "Shift+Enter")  # a new line, not a send
    page.type("#input", "What is your ship called?")
    assert page.locator(".msg").count() == 0
    page.press("#input", "Enter")
    assert page.locator("#input").is_disabled()
    assert page.locator("#stop").is_visible()
    lengths: set[int] = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = last_reply(page).evaluate("m => [m.dataset.text.length, m.dataset.finish || '']")
        lengths.add(state[0])
        if state[1]:
            break
        time.sleep(0.03)
    assert len(lengths - {0}) >= 2, f"the reply did not grow in steps: {sorted(lengths)}"
    reply = last_reply(page)
    text = reply.get_attribute("data-text")
    meta = reply.locator(".meta").inner_text()
    assert "TTFT" in meta and "tok/s" in meta and "completion tokens" in meta
    assert reply.get_attribute("data-finish") in ("stop", "length")
    assert page.locator("#input").is_enabled()
    assert page.locator(".msg.user .body").inner_text() == "Hello captain!\nWhat is your ship called?"

    stored = stored_messages(server, sid)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[1]["content"] == text
    assert page.locator("#sessions button.session").first.get_attribute("data-session") == sid

    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert page.evaluate("window.chatsvc.state.sessionId") == sid
    assert last_reply(page).get_attribute("data-text") == text
    assert page.locator(".msg.user .body").inner_text() == "Hello captain!\nWhat is your ship called?"
    # a second, longer turn, so the screenshot shows a conversation
    page.click("#options summary")
    page.fill("#opt-max-tokens", "64")
    page.fill("#opt-temperature", "0.8")
    page.click("#options summary")
    send(page, "Tell me about your crew in a short list.")
    wait_reply_done(page)
    shot = screenshot_dir(tmp_path) / "screenshot-chat.png"
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 0


def test_tool_call_and_its_result_are_shown(open_tab: Callable[..., Tab], server: Server) -> None:
    """A reply that calls a tool shows the call (name, arguments) and no markup; the tool's result, posted
    back as a tool message, shows in the transcript after a reload. The page runs no tool itself."""
    page = open_tab().page
    sid = start_chat(page, "pirate", max_tokens=150)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                             "required": ["city"]}}}]
    page.evaluate("tools => window.chatsvc.socket.sendMessage('Weather in Lisbon?', "
                  "{tools, tool_choice: 'required', parallel_tool_calls: false, max_tokens: 150, temperature: 0})",
                  tools)
    assert wait_reply_done(page) == "tool_calls"
    reply = last_reply(page)
    call = reply.locator(".tool-call")
    assert call.count() == 1 and "Tool call: get_weather" in call.inner_text()
    stored = stored_messages(server, sid)
    assert reply.locator(".tool-call pre").inner_text() == stored[1]["tool_calls"][0]["function"]["arguments"]
    assert "<tool_call>" not in reply.inner_text()
    call_id = reply.locator(".tool-call").get_attribute("data-call-id")
    assert call_id == stored[1]["tool_calls"][0]["id"]
    page.evaluate("id => window.chatsvc.socket.sendMessage('{\"temp_c\": 19}', "
                  "{role: 'tool', tool_call_id: id, max_tokens: 16, temperature: 0})", call_id)
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant').length == 2")
    wait_reply_done(page)
    page.reload()
    page.wait_for_selector(".msg.tool")
    result = page.locator(".msg.tool")
    assert result.get_attribute("data-tool-call-id") == call_id
    assert "Tool result" in result.inner_text() and '{"temp_c": 19}' in result.inner_text()
    assert page.locator(".msg.assistant").first.locator(".tool-call").count() == 1
    assert [m["role"] for m in stored_messages(server, sid)] == ["user", "assistant", "tool", "assistant"]


def test_stop_keeps_the_partial_reply(open_tab: Callable[..., Tab], server: Server) -> None:
    page = open_tab().page
    sid = start_chat(page, "assistant", max_tokens=400)
    send(page, "Write a long story about a dragon who learns to cook.")
    wait_reply_started(page)
    # With the model paused the reply cannot reach max_tokens before the click lands (it once did).
    with engine_paused(server):
        page.click("#stop")
        assert wait_reply_done(page) == "abort"
    reply = last_reply(page)
    partial = reply.get_attribute("data-text")
    assert partial
    assert "stopped" in (reply.get_attribute("class") or "")
    assert "stopped" in reply.locator(".meta").inner_text()
    assert page.locator("#input").is_enabled()
    stored = stored_messages(server, sid)[-1]
    assert stored["finish_reason"] == "abort"
    assert stored["content"] == partial
    assert stored["tokens"] < 400


def test_html_in_messages_is_shown_as_text(open_tab: Callable[..., Tab], server: Server) -> None:
    import redis

    page = open_tab().page
    sid = start_chat(page, "assistant", max_tokens=4)
    hostile = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
    send(page, hostile)
    wait_reply_done(page)
    assert page.locator(".msg.user .body").first.inner_text() == hostile

    # The model's words cannot be steered, so a hostile reply is planted in the stored history.
    reply = ('**bold** <img src=x onerror="window.__pwned=3">\n\n```html\n<script>window.__pwned=4</script>\n```\n'
             "- item <b>x</b>\n- `<i>code</i>`")
    from chatsvc.store import session_key

    r = redis.Redis(port=server.redis_port)
    r.rpush(session_key(sid) + ":messages", json.dumps(
        {"role": "assistant", "content": reply, "created": time.time(), "tokens": 9, "finish_reason": "stop"}))
    r.close()
    page.reload()
    page.wait_for_selector(".msg.assistant >> nth=1")
    body = last_reply(page).locator(".body")
    assert body.locator("strong").inner_text() == "bold"
    assert '<img src=x onerror="window.__pwned=3">' in body.locator("p").inner_text()
    assert body.locator("pre code").inner_text() == "<script>window.__pwned=4</script>"
    assert body.locator("li").all_inner_texts() == ["item <b>x</b>", "<i>code</i>"]
    assert page.locator("#messages img, #messages script, #messages b, #messages i").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_invalid_input_is_reported(open_tab: Callable[..., Tab], server: Server) -> None:
    page = open_tab().page
    start_chat(page, "tutor", max_tokens=8, temperature=5.0)  # the server allows 0..2
    send(page, "hi")
    page.wait_for_selector("#banner:not([hidden])")
    assert "Invalid request" in page.locator("#banner-text").inner_text()
    assert "temperature" in page.locator("#banner-text").inner_text()
    assert page.locator("#input").is_enabled()


def test_reconnect_resumes_the_reply_without_duplicates(open_tab: Callable[..., Tab], server: Server) -> None:
    tab = open_tab()
    page = tab.page
    sid = start_chat(page, "tutor", max_tokens=48)
    send(page, "Explain what a fraction is.")
    wait_reply_started(page)
    # 4000: an abnormal close, as when a network drops; the server keeps generating for a grace period
    page.evaluate("window.chatsvc.socket.ws.close(4000, 'test drop')")
    finish = wait_reply_done(page)
    assert finish in ("stop", "length")
    assert page.evaluate("window.chatsvc.socket.opened") >= 2
    stored = stored_messages(server, sid)[-1]
    assert last_reply(page).get_attribute("data-text") == stored["content"]

    # Server unreachable: new sockets fail while offline, which the page says, then it recovers.
    tab.context.set_offline(True)
    page.evaluate("window.chatsvc.socket.ws.close(4000, 'test drop')")
    page.wait_for_selector("#banner:not([hidden])", timeout=20_000)
    assert "cannot be reached" in page.locator("#banner-text").inner_text()
    tab.context.set_offline(False)
    page.wait_for_selector("#conn[data-state='open']", timeout=20_000)
    assert page.locator("#banner").is_hidden()


def test_reload_mid_reply_resumes_the_same_reply(open_tab: Callable[..., Tab], server: Server) -> None:
    page = open_tab().page
    sid = start_chat(page, "tutor", max_tokens=96)
    send(page, "Explain what a prime number is.")
    wait_reply_started(page)
    with engine_paused(server):  # the reply is mid-way while the page reloads (the socket closes with 1001)
        page.reload()
        page.wait_for_selector(".msg.assistant")
        time.sleep(0.5)
    finish = wait_reply_done(page)
    assert finish in ("stop", "length"), f"the reload aborted the reply ({finish})"
    stored = stored_messages(server, sid)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert page.locator(".msg.assistant").count() == 1
    assert last_reply(page).get_attribute("data-text") == stored[1]["content"]  # nothing shown twice


def test_memory_view_shows_a_persona_prompt_shared_by_two_sessions(
        open_tab: Callable[..., Tab], server: Server, tmp_path: Path) -> None:
    first = open_tab().page
    start_chat(first, "tutor", max_tokens=200)
    second = open_tab().page
    start_chat(second, "tutor", max_tokens=200)
    second.click("#toggle-memory")
    second.wait_for_selector("#kv-status:text('live')")
    send(first, "Explain photosynthesis step by step, in detail.")
    send(second, "Explain how a rainbow forms, step by step, in detail.")
    # Both replies read the pinned prompt blocks: refcount = the pin + two sequences.
    second.wait_for_function(
        """() => { const s = window.chatsvc.memory.snapshot;
                   return s && s.state.some((st, i) => st === 'pinned' && s.refcounts[i] >= 3); }""",
        timeout=30_000)
    second.wait_for_timeout(300)  # let the panel draw the frame it just received
    shared = int(second.locator("[data-count='shared']").inner_text())
    pinned = int(second.locator("[data-count='pinned']").inner_text())
    assert shared > 0 and pinned > 0
    assert int(second.locator("[data-stat='running']").inner_text()) >= 1
    assert int(second.locator("[data-stat='session']").inner_text()) > 0
    shot = screenshot_dir(tmp_path) / "screenshot-memory.png"
    second.screenshot(path=str(shot))
    assert shot.stat().st_size > 0
    for page in (first, second):
        if page.locator("#stop").is_visible():
            page.click("#stop")
        wait_reply_done(page)


def test_phone_width_layout(open_tab: Callable[..., Tab]) -> None:
    page = open_tab(width=390, height=844).page
    page.wait_for_selector("button.persona")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    assert not page.locator("#sidebar #new-chat").is_visible()
    page.click("#toggle-sidebar")
    page.wait_for_selector("#sidebar #new-chat", state="visible")
    page.keyboard.press("Escape")  # closes the drawer again
    page.wait_for_selector("#sidebar #new-chat", state="hidden")
    start_chat(page, "pirate", max_tokens=4)
    assert page.locator("#input").is_visible() and page.locator("#send").is_visible()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390


def test_a_long_session_shows_its_newest_messages_and_loads_earlier_ones(open_tab: Callable[..., Tab],
                                                                        server: Server) -> None:
    import asyncio
    import concurrent.futures

    from chatsvc.store import Store

    sid = server.api("POST", "/v1/sessions", json={"persona": "tutor"})["id"]

    async def fill() -> None:
        store = Store.from_url(f"redis://127.0.0.1:{server.redis_port}")
        try:
            for turn in range(1, 61):
                assert await store.begin_turn(sid, {"role": "user", "content": f"question {turn}"}) == turn
                await store.end_turn(sid, turn, {"role": "assistant", "content": f"answer {turn}"})
        finally:
            await store.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # Playwright's loop runs in this thread
        pool.submit(asyncio.run, fill()).result()
    page = open_tab().page
    page.goto(f"{server.url}/#session={sid}")
    page.reload()
    page.wait_for_selector(".load-earlier")
    assert page.locator(".msg").count() == 100
    assert page.locator(".msg .body").first.inner_text() == "question 11"
    page.click(".load-earlier")
    page.wait_for_function("() => document.querySelectorAll('.msg').length === 120")
    bodies = page.locator(".msg .body").all_inner_texts()
    assert bodies[:3] == ["question 1", "answer 1", "question 2"] and bodies[-1] == "answer 60"
    assert page.locator(".load-earlier").count() == 0  # nothing older is stored
