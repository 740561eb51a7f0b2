"""Upstream's JSON-extractor rejections for `POST /v1/loras`, as observed on upstream 1.6.1.

tests/e2e/test_upstream_parity.py compares many more bodies against upstream itself; these
cases keep the rules checked where upstream's venv is absent.
"""

from __future__ import annotations

import pytest

from dynamo.runtime.system.json_body import Rejection, extract
from dynamo.runtime.system.loras import LOAD_LORA_REQUEST

pytestmark = pytest.mark.unit

DATA = "Failed to deserialize the JSON body into the target type: "
SYNTAX = "Failed to parse the request body as JSON: "


@pytest.mark.parametrize(
    ("body", "status", "text"),
    [
        (b"{}", 422, DATA + "missing field `lora_name` at line 1 column 2"),
        (
            b'{"lora_name": 3}',
            422,
            DATA + "lora_name: invalid type: integer `3`, expected a string at line 1 column 15",
        ),
        (b'{"lora_name":"x"}', 422, DATA + "missing field `source` at line 1 column 17"),
        (
            b'{"lora_name":"x","source":{"uri":5}}',
            422,
            DATA + "source.uri: invalid type: integer `5`, expected a string at line 1 column 34",
        ),
        (
            b"[]",
            422,
            DATA + "invalid length 0, expected struct LoadLoraRequest with 2 elements at line 1 "
            "column 2",
        ),
        (
            b'{"lora_name":1e16}',
            422,
            DATA + "lora_name: invalid type: floating point `1e+16`, expected a string at line 1 "
            "column 17",
        ),
        (
            b'{"lora_name":"x","lora_name":"y"}',
            422,
            DATA + "duplicate field `lora_name` at line 1 column 28",
        ),
        (
            b'{\n "lora_name": 3\n}',
            422,
            DATA + "lora_name: invalid type: integer `3`, expected a string at line 2 column 15",
        ),
        (b"", 400, SYNTAX + "EOF while parsing a value at line 1 column 0"),
        (b"nope", 400, SYNTAX + "expected ident at line 1 column 2"),
        (b'{"lora_name":"x",}', 400, SYNTAX + "trailing comma at line 1 column 18"),
        (b'{"x":[1,}', 400, SYNTAX + "x: expected value at line 1 column 9"),
        (
            b'{"lora_name":"\\ud800x"}',
            400,
            SYNTAX + "lora_name: unexpected end of hex escape at line 1 column 21",
        ),
    ],
)
def test_rejections(body: bytes, status: int, text: str) -> None:
    with pytest.raises(Rejection) as info:
        extract("application/json", body, LOAD_LORA_REQUEST)
    assert (info.value.status, info.value.text) == (status, text)


def test_content_type_and_accepted_forms() -> None:
    with pytest.raises(Rejection) as info:
        extract(None, b"{}", LOAD_LORA_REQUEST)
    assert (info.value.status, info.value.text) == (
        415,
        "Expected request with `Content-Type: application/json`",
    )
    body = b'{"lora_name": "a", "source": {"uri": "s3://b/k", "sha256": "ab"}, "x": [1]} trailing'
    # Unknown fields are kept for the engine (our `sha256`); what follows the value is ignored.
    assert extract("application/vnd.api+json", body, LOAD_LORA_REQUEST) == {
        "lora_name": "a",
        "source": {"uri": "s3://b/k", "sha256": "ab"},
        "x": [1],
    }
    assert extract("application/json", b'["a", ["s3://b/k"]]', LOAD_LORA_REQUEST) == {
        "lora_name": "a",
        "source": {"uri": "s3://b/k"},
    }
