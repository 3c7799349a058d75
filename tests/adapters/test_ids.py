import re

import pytest

from loragw.adapters.errors import AdapterError, InvalidAdapterId
from loragw.adapters.ids import MAX_ADAPTER_ID_LEN, validate_adapter_id

GOOD = [
    "a",
    "sql-lora",
    "my_adapter.v2",
    "ORG/REPO",
    "meta-llama/Llama-3.2-1B-lora_r16",
    "a..b",
    "0",
    "x" * MAX_ADAPTER_ID_LEN,
    "o/" + "x" * (MAX_ADAPTER_ID_LEN - 2),
]

BAD = {
    "..": "'..'",
    ".": "'.'",
    "a/../b": "'..' path component",
    "../b": "'..'",
    "a/..": "'..'",
    "/etc/passwd": "absolute path",
    "/a": "absolute path",
    "a//b": "empty component",
    "a/": "empty component",
    "a/b/c": "more than one '/'",
    "a\nb": "control character",
    "a\x00b": "control character",
    "a\x7fb": "control character",
    "": "empty",
    "x" * (MAX_ADAPTER_ID_LEN + 1): "characters; at most",
    "café": "non-ASCII",
    "ad\u200bapter": "non-ASCII",
    "a\\b": "backslash",
    "..\\..\\x": "backslash",
    ".hidden": "must not start with '.'",
    "org/.hidden": "must not start with '.'",
    "-rf": "must not start with '-'",
    "a b": "contains [' ']",
    "base:adapter": "contains [':']",
    "a?b": "contains ['?']",
    "~/x": "contains ['~']",
}


@pytest.mark.parametrize("adapter_id", GOOD)
def test_good_ids_pass_unchanged(adapter_id):
    assert validate_adapter_id(adapter_id) == adapter_id


@pytest.mark.parametrize("adapter_id", list(BAD))
def test_bad_ids_are_refused_naming_the_problem(adapter_id):
    with pytest.raises(InvalidAdapterId, match=re.escape(BAD[adapter_id])):
        validate_adapter_id(adapter_id)


def test_invalid_id_is_a_400_adapter_error():
    with pytest.raises(AdapterError) as info:
        validate_adapter_id("../x")
    assert info.value.status == 400


@pytest.mark.parametrize("value", [None, 3, b"abc"])
def test_non_strings_are_refused(value):
    with pytest.raises(InvalidAdapterId, match="must be a string"):
        validate_adapter_id(value)
