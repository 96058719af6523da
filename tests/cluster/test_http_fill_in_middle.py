"""Completions with a `suffix` (fill in the middle) on a real cluster serving a code model (the
tiny checkpoint with Qwen2.5-Coder's fill-in-the-middle tokens), through the `openai` SDK,
gRPC and `radixmesh generate --suffix`: the prompt is the model's form, whether the prompt
comes as text or ids, whole or streamed, alone or with others; the middle ends at a token
that opens another; the form's prefix is served from the cache on the next call; what cannot
be filled in is refused by name. (A model without the tokens refusing it:
tests/cluster/test_http_errors.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from cluster.client import Client, text_request
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from tests.cluster.test_cli_client import run
from tests.cluster.test_migration import kill_the_busiest, stream, undisturbed
from tests.cluster.tool_fixtures import openai_client, served
from tests.worker.fim_fixtures import QWEN, fim_checkpoint
from worker.loader import LoadedModel, load_model
from worker.tokenizer import Tokenizer

BEFORE = "def add(a, b):\n    "
AFTER = "\n\nprint(add(1, 2))\n"
SETTINGS = {"model": SERVED_NAME, "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(fim_checkpoint(tmp_path_factory.mktemp("coder") / "model"))


@pytest.fixture(scope="module")
def cluster(coder: LoadedModel) -> Iterator[LocalCluster]:
    yield from served(coder)


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    yield from openai_client(cluster)


@pytest.fixture(scope="module")
def tokenizer(coder: LoadedModel) -> Tokenizer:
    return Tokenizer.from_dir(Path(coder.path))


def form_ids(tokenizer: Tokenizer, before: str, after: str) -> list[int]:
    """The prompt the model is meant to get: its three tokens around the two texts."""
    ids = [tokenizer.token_to_id(t) for t in (QWEN.prefix, QWEN.suffix, QWEN.middle)]
    assert None not in ids
    text = tokenizer.encode(before), tokenizer.encode(after, add_special_tokens=False)
    return [ids[0], *text[0], ids[1], *text[1], ids[2]]  # type: ignore[list-item]


def test_a_suffix_makes_the_models_prompt(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """The text prompt, the same prompt as ids, and the form written out as ids get the same
    answer from the same number of prompt tokens."""
    written = form_ids(tokenizer, BEFORE, AFTER)
    expected = client.completions.create(prompt=written, **SETTINGS)
    from_text = client.completions.create(prompt=BEFORE, suffix=AFTER, **SETTINGS)
    from_ids = client.completions.create(prompt=tokenizer.encode(BEFORE), suffix=AFTER, **SETTINGS)
    assert expected.usage is not None and expected.usage.prompt_tokens == len(written)
    for answer in (from_text, from_ids):
        assert answer.choices[0].text == expected.choices[0].text
        assert answer.choices[0].finish_reason == expected.choices[0].finish_reason
        assert answer.usage is not None and answer.usage.prompt_tokens == len(written)
    without = client.completions.create(prompt=BEFORE, **SETTINGS)
    assert without.usage is not None and without.usage.prompt_tokens < len(written)


def test_streamed_and_several_alike_and_echo_refused(client: openai.OpenAI) -> None:
    whole = client.completions.create(prompt=BEFORE, suffix=AFTER, **SETTINGS)
    text = whole.choices[0].text
    stream = client.completions.create(prompt=BEFORE, suffix=AFTER, stream=True, **SETTINGS)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == text
    other = "def mul(a, b):\n    "
    alone = client.completions.create(prompt=other, suffix=AFTER, **SETTINGS).choices[0].text
    both = client.completions.create(prompt=[BEFORE, other], suffix=AFTER, **SETTINGS)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [text, alone]
    with pytest.raises(openai.BadRequestError) as refused:  # the prompt read is not the text
        client.completions.create(prompt=BEFORE, suffix=AFTER, echo=True, **SETTINGS)
    assert refused.value.body["param"] == "echo"  # type: ignore[index]
    assert "not with suffix" in refused.value.body["message"]  # type: ignore[index]


def test_a_middle_ends_at_a_token_that_opens_another(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    """Pushed to write the form's first token first: a request with a suffix stops there (the
    token's text not written), the same prompt sent as ids without one runs on."""
    opening = tokenizer.token_to_id(QWEN.prefix)
    pushed = {**SETTINGS, "logit_bias": {str(opening): 100}}
    filled = client.completions.create(prompt=BEFORE, suffix=AFTER, **pushed)
    assert filled.choices[0].finish_reason == "stop" and filled.choices[0].text == ""
    assert filled.usage is not None and filled.usage.completion_tokens == 1
    written = client.completions.create(prompt=form_ids(tokenizer, BEFORE, AFTER), **pushed)
    assert written.choices[0].finish_reason == "length"
    assert written.choices[0].text.startswith(QWEN.prefix)


def test_the_forms_prefix_is_read_from_the_cache(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    """An editor asks again as the text after the cursor changes: the file's head, written
    first in the form, is served from the cache (in whole pages of 4 positions)."""
    head = "import math\n\n\ndef area(radius):\n    return math.pi * radius * radius\n\n\n" * 3
    client.completions.create(prompt=head, suffix="\nprint(1)\n", **SETTINGS)
    again = client.completions.create(prompt=head, suffix="\nprint(2)\n", **SETTINGS)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens or 0
    shared = 1 + len(tokenizer.encode(head)) + 1  # the prefix token, the head, the suffix token
    assert shared // 4 * 4 <= cached < again.usage.prompt_tokens


def test_grpc_fills_in_the_middle_and_refuses_a_chat(
    cluster: LocalCluster, client: openai.OpenAI
) -> None:
    request = text_request(BEFORE, max_tokens=12)
    request.suffix = AFTER
    answer = "".join(r.text for r in Client(cluster.target).generate(request, timeout=60))
    assert (
        answer == client.completions.create(prompt=BEFORE, suffix=AFTER, **SETTINGS).choices[0].text
    )
    chat = text_request(chat=[("user", "hello")], max_tokens=4)
    chat.suffix = AFTER
    with pytest.raises(grpc.RpcError) as refused:
        list(Client(cluster.target).generate(chat, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "suffix: is for a text or token-id prompt, not messages" in refused.value.details()
    cluster.wait_idle()


def test_the_cli_fills_in_the_middle(cluster: LocalCluster, client: openai.OpenAI) -> None:
    ran = run(
        "generate", BEFORE, "--suffix", AFTER, "--max-tokens", "12", "--target", cluster.target
    )
    assert ran.returncode == 0, ran.stderr
    answer = client.completions.create(prompt=BEFORE, suffix=AFTER, **SETTINGS)
    assert ran.stdout.removesuffix("\n") == answer.choices[0].text


def test_a_middle_cut_by_a_dying_worker_continues_exactly(coder: LoadedModel) -> None:
    """A suffix request's stream moved to another worker when its own is killed: the router
    made the form's ids once, and the resumed sample continues from them (nothing wrapped
    twice, the middle's end tokens still stopping it), token for token as undisturbed."""
    cluster = start_cluster(coder, workers=2)
    try:
        message = text_request(BEFORE, max_tokens=40, temperature=0)
        message.suffix = AFTER
        want = undisturbed(cluster, message)
        assert len(want.messages) >= 12, want.seen()  # long enough to be cut
        cut = stream(Client(cluster.target), message)
        moved = kill_the_busiest(cluster, [cut], 8)
        assert cut.error is None and moved == [cut]
        assert cut.seen() == want.seen()
        assert cluster.service.counters.migrated >= 1
        cluster.wait_idle()
    finally:
        cluster.close()
