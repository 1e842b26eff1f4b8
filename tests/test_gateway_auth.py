from __future__ import annotations

import pytest
from starlette.datastructures import Headers, QueryParams

from chatsvc.auth import ANON, Auth, host_allowed, origin_allowed, owner_id, ws_key_from_protocols
from chatsvc.errors import APIError
from chatsvc.keyring import Keys
from chatsvc.settings import LOOPBACK_HOSTS, Settings

PATTERNS = Settings().allowed_origins
SECRET = b"s" * 32


def test_no_keys_means_everyone_is_anonymous() -> None:
    auth = Auth(())
    assert auth.from_http(Headers({})) == ANON and auth.is_admin(ANON)


def test_keys_are_checked_and_owners_differ() -> None:
    auth = Auth(("k1", "k2"), admin_keys=("adm",))
    with pytest.raises(APIError) as e:  # the owner ids need the server secret first
        auth.from_http(Headers({"authorization": "Bearer k1"}))
    assert e.value.status == 503
    auth.set_secret(SECRET)
    assert auth.from_http(Headers({"authorization": "Bearer k1"})) == owner_id("k1", SECRET)
    assert owner_id("k1", SECRET) != owner_id("k2", SECRET) and owner_id("k1", SECRET) != owner_id("k1", b"other")
    assert auth.is_admin(auth.check_key("adm")) and not auth.is_admin(auth.check_key("k1"))
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"}):
        with pytest.raises(APIError) as e:
            auth.from_http(Headers(headers))
        assert e.value.status == 401


def test_a_key_in_the_url_is_refused() -> None:
    auth = Auth(("k2",))
    auth.set_secret(SECRET)
    with pytest.raises(APIError) as e:
        auth.from_http(Headers({"authorization": "Bearer k2"}), QueryParams("api_key=k2"))
    assert (e.value.status, e.value.code) == (400, "api_key_in_url")


def test_ws_protocol_key_is_never_the_selected_protocol() -> None:
    key, proto = ws_key_from_protocols(Headers({"sec-websocket-protocol": "chatsvc, chatsvc.key.abc"}))
    assert (key, proto) == ("abc", "chatsvc")
    assert ws_key_from_protocols(Headers({"sec-websocket-protocol": "chatsvc.key.abc"})) == ("abc", None)
    assert ws_key_from_protocols(Headers({})) == (None, None)


@pytest.mark.parametrize(
    ("origin", "host", "ok"),
    [
        (None, "h:8000", True),
        ("http://h:8000", "h:8000", True),
        ("http://localhost:5173", "h:8000", False),
        ("http://localhost:5173", "localhost:8000", False),
        ("http://127.0.0.1:9", "h:8000", False),
        ("https://chat.example.com", "chat.example.com", True),
        ("https://evil.example", "chat.example.com", False),
        ("http://localhost.evil.example:80", "h:8000", False),
        ("null", "h:8000", False),
    ],
)
def test_origin(origin: str | None, host: str, ok: bool) -> None:
    assert origin_allowed(origin, host, PATTERNS) is ok


@pytest.mark.parametrize(("host", "ok"), [("localhost:8000", True), ("127.0.0.1", True), ("[::1]:80", True),
                                          ("evil.example", False), ("127.0.0.1.evil.example:80", False),
                                          (None, False)])
def test_host(host: str | None, ok: bool) -> None:
    assert host_allowed(host, LOOPBACK_HOSTS) is ok
    assert host_allowed(host, ("*",))


def test_a_crafted_expiry_is_an_invalid_signature_not_an_error() -> None:
    """The signature is checked over the text as sent before the expiry is parsed: digits int() refuses
    (a superscript, thousands of them) or that parse but were never signed are all a plain 401."""
    auth = Auth(("k1",))
    auth.set_secret(SECRET)
    owner = auth.check_key("k1")
    for expiry in ("\u00b2\u00b2", "9" * 5000, "\u0661\u0662", "12\n", " 12"):
        with pytest.raises(APIError) as e:
            auth.check_token(f"cst1.{owner}.{expiry}.{'0' * 64}")
        assert (e.value.status, e.value.code) == (401, "invalid_api_key"), expiry


def test_access_tokens_name_their_owner_expire_and_cannot_be_forged() -> None:
    auth = Auth(("k1", "k2"), admin_keys=("adm",))
    auth.set_secret(SECRET)
    owner = auth.check_key("k1")
    token, expires = auth.issue_token(owner, 60, now=1000.0)
    assert expires == 1060 and "k1" not in token
    assert auth.check_token(token, now=1059.0) == owner
    live, _ = auth.issue_token(owner, 60)
    assert auth.check_key(live) == owner  # wherever a key is accepted
    with pytest.raises(APIError) as e:
        auth.check_key(live, tokens=False)  # where only a key will do
    assert e.value.status == 401
    with pytest.raises(APIError) as e:
        auth.check_token(token, now=1060.0)
    assert (e.value.status, e.value.code) == (401, "token_expired")
    prefix, owner_part, expiry, signature = token.split(".")
    other = auth.check_key("k2")
    forged = [f"{prefix}.{other}.{expiry}.{signature}",  # another owner
              f"{prefix}.{owner_part}.{int(expiry) + 3600}.{signature}",  # a later expiry
              f"{prefix}.{owner_part}.{expiry}.{signature[:-1]}{'0' if signature[-1] != '0' else '1'}",
              f"{prefix}.{owner_part}.{expiry}", f"{prefix}.{owner_part}.-5.{signature}", "cst1.", "cst1...."]
    for bad in forged:
        with pytest.raises(APIError) as e:
            auth.check_token(bad, now=1000.0)
        assert (e.value.status, e.value.code) == (401, "invalid_api_key"), bad
    # Signed under another server secret: refused; admin rights follow the owner.
    elsewhere = Auth(("k1",))
    elsewhere.set_secret(b"t" * 32)
    with pytest.raises(APIError):
        elsewhere.check_token(token, now=1000.0)
    admin_token, _ = auth.issue_token(auth.check_key("adm"), 60, now=1000.0)
    assert auth.is_admin(auth.check_token(admin_token, now=1000.0))
    # A key removed from the configuration takes its tokens with it.
    fewer = Auth(("k2",))
    fewer.set_secret(SECRET)
    with pytest.raises(APIError) as e:
        fewer.check_token(token, now=1000.0)
    assert "no longer accepted" in e.value.message


def test_cache_salts_differ_per_owner_and_cannot_be_computed_from_the_owner_id() -> None:
    auth, other = Auth(("a", "b")), Auth(("a", "b"))
    auth.set_secret(b"s" * 32)
    other.set_secret(b"t" * 32)
    a, b = (auth.check_key(k) for k in ("a", "b"))
    assert auth.cache_salt(a) == auth.cache_salt(a) != auth.cache_salt(b)
    assert a not in auth.cache_salt(a)
    # Keyed by the server secret (a key derived from it, not the owner ids' key): another secret, other salts.
    assert other.cache_salt(a) != auth.cache_salt(a)
    assert auth.cache_salt(a) != owner_id(a, b"s" * 32)[1:]


def test_tokens_of_a_previous_secret_verify_until_it_is_dropped() -> None:
    """The current secret signs, every accepted one verifies; owner ids follow the identity key, not the
    secret, so a rotation changes no owner."""
    identity, old, new = b"i" * 32, b"o" * 40, b"n" * 40
    before, during, after = Auth(("k1",)), Auth(("k1",)), Auth(("k1",))
    before.set_keys(Keys.derive(identity, (old,)))
    during.set_keys(Keys.derive(identity, (new, old)))
    after.set_keys(Keys.derive(identity, (new,)))
    owner = before.check_key("k1")
    assert during.check_key("k1") == after.check_key("k1") == owner
    assert before.cache_salt(owner) == after.cache_salt(owner)
    old_token, _ = before.issue_token(owner, 60)
    new_token, _ = during.issue_token(owner, 60)
    assert during.check_key(old_token) == during.check_key(new_token) == owner
    assert after.check_key(new_token) == owner
    with pytest.raises(APIError) as e:
        after.check_key(old_token)
    assert (e.value.status, e.value.code) == (401, "invalid_api_key")
    with pytest.raises(APIError):  # signed with the new secret: not accepted where only the old one is
        before.check_key(new_token)
