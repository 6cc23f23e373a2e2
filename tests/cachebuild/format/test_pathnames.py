"""The file-name codec of paths.json: every name a POSIX filesystem holds survives JSON, byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachebuild.errors import CacheCorruptError
from cachebuild.format.manifest import decode_path, decode_paths, encode_path, encode_paths


def _through_json(value: object) -> object:
    return json.loads(json.dumps(value, ensure_ascii=False).encode("utf-8").decode("utf-8"))


@settings(max_examples=200, deadline=None, database=None)
@given(st.binary(min_size=1, max_size=60).filter(lambda b: b"\0" not in b))
def test_any_name_round_trips_through_utf8_json(raw: bytes) -> None:
    name = os.fsdecode(raw)
    entry = _through_json(encode_path(name))
    assert os.fsencode(decode_path(entry)) == raw
    try:
        raw.decode("utf-8")
        assert entry == name  # valid UTF-8: stored as the plain string, as before
    except UnicodeDecodeError:
        assert isinstance(entry, dict) and set(entry) == {"bytes"}


def test_the_documented_example() -> None:
    name = os.fsdecode(b"n01/bad_\xff\xfe_name.JPEG")
    assert encode_path(name) == {"bytes": "n01/bad_\\xff\\xfe_name.JPEG"}
    assert json.dumps(encode_path(name)) == '{"bytes": "n01/bad_\\\\xff\\\\xfe_name.JPEG"}'
    # A backslash in a non-UTF-8 name is escaped, so it can never read as a byte escape.
    tricky = os.fsdecode(b"a\\xff\xfe")
    assert encode_path(tricky) == {"bytes": "a\\\\xff\\xfe"}
    assert os.fsencode(decode_path(encode_path(tricky))) == b"a\\xff\xfe"
    assert encode_paths(["x", name]) == ["x", encode_path(name)] and decode_paths(encode_paths(["x", name])) == \
        ["x", name]


def test_a_decoded_name_opens_the_file(tmp_path: Path) -> None:
    raw = b"caf\xe9 \xff.JPEG"
    (tmp_path / os.fsdecode(raw)).write_bytes(b"pixels")
    entry = _through_json(encode_path(os.listdir(tmp_path)[0]))
    assert (tmp_path / decode_path(entry)).read_bytes() == b"pixels"


@pytest.mark.parametrize("entry", [{"bytes": "a\\x"}, {"bytes": "a\\q"}, {"bytes": "a\\xZZ"}, {"bytes": "\udcff"},
                                   {"bytes": "\udcff\\x41"}, {"bytes": 3}, {"path": "a"}, {"bytes": "a", "extra": 1}, 7,
                                   None, ["a"]])
def test_malformed_entries_are_named_errors(entry: object) -> None:
    with pytest.raises(CacheCorruptError, match=r"paths\.json"):
        decode_path(entry)


def test_a_name_no_filesystem_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        encode_path("\ud800")
