"""Every CACHEBUILD_* knob is declared once (cachebuild.settings), read when asked, checked with an error that
names the variable, and every reader of the environment goes through it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from cachebuild.errors import OptionError
from cachebuild.settings import KNOBS, Settings, defaults, settings
from tests.repo import REPO

# What each knob holds when it is not set; the declaration is the one place these live.
DEFAULTS = {"retries": 10, "retry_budget_s": 120.0, "http_timeout_s": 60.0,
            "home": Path.home() / ".cache" / "cachebuild", "pin_versions": True, "hedge": True, "hedge_factor": 3.0,
            "hedge_after_s": 0.05, "readahead_files": 1, "push_stale_s": 300.0, "store": None, "lease_s": 600.0,
            "http_token": None}


def test_one_field_per_variable_and_the_defaults() -> None:
    assert [f.name for f in dataclasses.fields(Settings)] == list(DEFAULTS)
    assert len({k.env for k in KNOBS}) == len(KNOBS) == 13
    assert all(k.env.startswith("CACHEBUILD_") and k.meaning for k in KNOBS)
    assert dataclasses.asdict(defaults()) == DEFAULTS
    assert dataclasses.asdict(settings({k.env: "" for k in KNOBS})) == DEFAULTS  # empty: unset


def test_no_module_reads_a_knob_from_the_environment_itself() -> None:
    """The variables are named in code only by their declaration (and in docstrings and messages)."""
    readers = []
    for path in sorted([*(REPO / "cachebuild").rglob("*.py"), *(REPO / "loaders").rglob("*.py")]):
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"(?:environ(?:\.get)?\s*[\[(]|getenv\()\s*[\"'](CACHEBUILD_\w+)", text):
            readers.append(f"{path.relative_to(REPO)}: {m.group(1)}")
    assert readers == []


@pytest.mark.parametrize(("env", "value", "why"), [
    ("CACHEBUILD_RETRIES", "2.5", "is not a whole number"),
    ("CACHEBUILD_RETRIES", "0", "must be at least 1"),
    ("CACHEBUILD_RETRY_BUDGET", "soon", "is not a number"),
    ("CACHEBUILD_HTTP_TIMEOUT", "-1", "must be positive"),
    ("CACHEBUILD_HTTP_TIMEOUT", "nan", "must be positive"),
    ("CACHEBUILD_PIN_VERSIONS", "maybe", "is neither 1 (on) nor 0 (off)"),
    ("CACHEBUILD_HEDGE", "2", "is neither 1 (on) nor 0 (off)"),
    ("CACHEBUILD_HEDGE_FACTOR", "0", "must be positive"),
    ("CACHEBUILD_HEDGE_AFTER", "x", "is not a number"),
    ("CACHEBUILD_READAHEAD_FILES", "-1", "must be 0 (off) or more"),
    ("CACHEBUILD_READAHEAD_FILES", "one", "is not a whole number"),
    ("CACHEBUILD_PUSH_STALE_S", "0", "must be positive"),
    ("CACHEBUILD_LEASE_S", "-5", "must be positive"),
])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch, env: str, value: str,
                                                    why: str) -> None:
    monkeypatch.setenv(env, value)
    with pytest.raises(OptionError) as err:
        settings()
    assert str(err.value).startswith(f"{env}={value!r} {why}; unset it or give e.g. {env}="), err.value


def test_switches_take_the_usual_spellings() -> None:
    for text, on in (("1", True), ("0", False), ("yes", True), ("OFF", False), (" true ", True), ("no", False)):
        assert settings({"CACHEBUILD_HEDGE": text}).hedge is on
    assert settings({"CACHEBUILD_HOME": "~/caches"}).home == Path.home() / "caches"


def test_values_are_read_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Changing the environment between two calls changes what each reader sees: the settings object, the
    remote layer's policy, the build's default output and a push's claim lifetime."""
    from cachebuild.builder.pipeline import default_out
    from cachebuild.share.claim import PushClaim
    from cachebuild.storage import open_location
    from cachebuild.storage.remote import retry

    monkeypatch.setenv("CACHEBUILD_RETRIES", "3")
    monkeypatch.setenv("CACHEBUILD_HOME", str(tmp_path / "a"))
    monkeypatch.setenv("CACHEBUILD_PUSH_STALE_S", "40")
    claim = PushClaim(open_location(tmp_path), "marker.json")
    assert (settings().retries, retry.Budget().settings.retries) == (3, 3)
    assert default_out("cifar10", 32, "crop", "npy") == tmp_path / "a" / "cifar10-32"
    assert (claim.stale_s, claim.hold_s, claim.heartbeat_s) == (40.0, 20.0, 4.0)  # renewed well within its hold
    monkeypatch.setenv("CACHEBUILD_RETRIES", "7")
    monkeypatch.setenv("CACHEBUILD_HOME", str(tmp_path / "b"))
    monkeypatch.setenv("CACHEBUILD_PUSH_STALE_S", "600")
    assert (settings().retries, retry.Budget().settings.retries) == (7, 7)
    assert default_out("cifar10", 32, "crop", "npy") == tmp_path / "b" / "cifar10-32"
    claim = PushClaim(open_location(tmp_path), "marker.json")
    assert (claim.stale_s, claim.hold_s, claim.heartbeat_s) == (600.0, 300.0, 30.0)
    monkeypatch.setenv("CACHEBUILD_HTTP_TIMEOUT", "zero")
    with pytest.raises(OptionError, match=r"^CACHEBUILD_HTTP_TIMEOUT='zero' is not a number"):
        retry.Budget()


def test_the_http_token_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read like any knob, but kept out of the settings' repr (a log line of them shows no credential)."""
    monkeypatch.setenv("CACHEBUILD_HTTP_TOKEN", "  tok-123  ")
    s = settings()
    assert s.http_token == "tok-123" and "tok-123" not in repr(s)
    knob = next(k for k in KNOBS if k.env == "CACHEBUILD_HTTP_TOKEN")
    assert knob.secret and not any(k.secret for k in KNOBS if k is not knob)
