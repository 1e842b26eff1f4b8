"""chatsvc/settings.py: keys from the environment, and safe defaults."""

from __future__ import annotations

import pytest

from chatsvc.settings import Settings, api_keys_from_env


def test_api_keys_from_env_are_comma_separated_and_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATSVC_API_KEYS", " k1, k2 ,,k3 ")
    assert api_keys_from_env() == ("k1", "k2", "k3")
    monkeypatch.setenv("CHATSVC_ADMIN_KEYS", "root")
    assert api_keys_from_env("CHATSVC_ADMIN_KEYS") == ("root",)
    monkeypatch.delenv("CHATSVC_API_KEYS")
    assert api_keys_from_env() == ()


def test_defaults_are_closed() -> None:
    s = Settings()
    assert s.api_keys == () and s.allowed_origins == ()  # only the server's own origin
    assert 0 < s.max_pinned_fraction <= 0.25
    with pytest.raises(AttributeError):
        s.api_keys = ("x",)  # type: ignore[misc]  # frozen: built once, passed around


def test_every_flagged_setting_has_its_flag_and_help() -> None:
    from chatsvc.settings import flag_fields

    flags = [f.metadata["flag"] for f in flag_fields()]
    assert len(flags) == len(set(flags)) and all(f.startswith("--") for f in flags)
    assert all(f.metadata["help"] for f in flag_fields())
    assert "session_ttl_s" in {f.name for f in flag_fields()}
