"""A batch's input file read into its requests (cluster/http/batch_schema.py), for any bytes a
client may upload: it never raises; either every non-blank line is a request, in order, or the
batch fails with errors that each name a line of the file (the first 100); a well-formed file
reads back exactly as written."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from cluster.http.batch_schema import MAX_ERRORS, read_lines

ENDPOINT = "/v1/chat/completions"
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
requests = st.fixed_dictionaries(
    {
        "custom_id": st.text(min_size=1, max_size=8),
        "method": st.just("POST"),
        "url": st.just(ENDPOINT),
        "body": st.dictionaries(
            st.sampled_from(["model", "messages", "max_tokens", "temperature"]), json_values
        ),
    }
)


@given(st.binary(max_size=400) | st.text(max_size=400).map(str.encode))
def test_any_bytes_read_as_requests_or_as_errors_naming_lines(content: bytes) -> None:
    lines, errors = read_lines(content, ENDPOINT)
    assert len(errors) <= MAX_ERRORS
    rows = len(content.split(b"\n"))
    for error in errors:
        assert error.line is None or 1 <= error.line <= rows
        assert error.line is None or error.message.startswith(f"line {error.line}: ")
    if not errors:  # a request per non-blank line, in order
        assert lines
        numbers = [x.number for x in lines]
        assert numbers == sorted(set(numbers)) and numbers[-1] <= rows


@given(st.lists(st.one_of(requests, json_values), max_size=12), st.sampled_from(["\n", "\r\n"]))
def test_each_line_is_a_request_or_an_error_of_its_own(items: list[object], end: str) -> None:
    content = end.join(json.dumps(x, ensure_ascii=False) for x in items).encode()
    lines, errors = read_lines(content, ENDPOINT)
    if not items:
        assert [e.code for e in errors] == ["empty_file"]
        return
    ids = [x["custom_id"] for x in items if isinstance(x, dict) and "custom_id" in x]
    good = all(
        isinstance(x, dict) and x.keys() == {"custom_id", "method", "url", "body"} for x in items
    )
    if good and len(set(ids)) == len(ids):
        assert errors == []
        assert [(x.number, x.custom_id, x.body) for x in lines] == [
            (i, x["custom_id"], x["body"])
            for i, x in enumerate(items, 1)  # type: ignore[index]
        ]
    else:
        assert errors and {e.line for e in errors} <= set(range(1, len(items) + 1))
