"""The front port's routing (magnetar.serve.router), without processes: a document's questions go where its first
went, a new document to the replica routed fewer (the fewest in flight first), a conversation's next turn follows
its earlier turns, ids made on a replica send their requests there. The served front is tested with two replicas
under torchrun in tests/test_serve_dist.py."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra: pip install 'magnetar[serve]'")

from magnetar.serve.router import BLOCK, PrefixRouter, _learn_from, block_digests, prompt_text  # noqa: E402

DOC = "The ledger of the harbour, line by line. " * 40
OTHER = "A different archive altogether, its own words. " * 40


def chat(doc: str, question: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": f"{doc}\n\n{question}"}], **extra}


def test_a_documents_questions_follow_its_first_and_new_documents_spread():
    r = PrefixRouter(2)
    first, why = r.choose(chat(DOC, "Q1?"))
    assert why == "load"
    assert [r.choose(chat(DOC, f"Q{i}?")) for i in range(2, 6)] == [(first, "prefix")] * 4
    other, why = r.choose(chat(OTHER, "Q?"))
    assert other != first and why == "load"  # routed fewer so far
    r.inflight[other] = 5  # busy: a third new document goes to the idle one
    assert r.choose(chat("Yet another text entirely. " * 40, "Q?"))[0] == first
    # the next turn of a conversation: its earlier turns are its prefix
    turn2 = {"model": "m", "messages": [{"role": "user", "content": f"{OTHER}\n\nQ?"},
                                        {"role": "assistant", "content": "A."}, {"role": "user", "content": "Why?"}]}
    assert r.choose(turn2) == (other, "prefix")


def test_ids_made_on_a_replica_route_there():
    r = PrefixRouter(3)
    _learn_from(r, b'{"id": "ctx-1", "object": "context"}', 2)
    _learn_from(r, b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_9"}}\n\n', 1)
    assert r.choose(chat(DOC, "?", magnetar={"context_id": "ctx-1"})) == (2, "owner")
    assert r.choose({"model": "m", "input": "Why?", "previous_response_id": "resp_9"}) == (1, "owner")
    assert r.owner("nosuch") is None


def test_prompt_text_and_blocks():
    body = {"model": "m", "instructions": "Be brief.", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hello"}]}], "magnetar": {"context": "DOC"}}
    assert prompt_text(body) == "DOC\nBe brief.\nuser:hello"
    text = "x" * (3 * BLOCK + 5)
    digests = block_digests(text)
    assert len(digests) == 3 and block_digests(text[:2 * BLOCK]) == digests[:2]
    assert prompt_text({"prompt": [[1, 2, 3]]}) == "[[1, 2, 3]]"


def test_any_json_body_is_read_without_an_error():
    """The front reads a body only to route it; the replica refuses what is malformed. Before, a content part whose
    "text" was not a string (Schemathesis sent {"text": {}}) raised inside the front: a 500 with no OpenAI body
    where the replica would have answered 400 naming the field."""
    hypothesis = pytest.importorskip("hypothesis", reason="the test extra: pip install 'magnetar[test]'")
    st = hypothesis.strategies
    json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                               lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner,
                                                                                           max_size=4), max_leaves=20)
    keys = st.sampled_from(["messages", "input", "prompt", "instructions", "context", "magnetar", "model"])
    parts = st.dictionaries(st.sampled_from(["type", "text", "role", "content", "output"]), json_values, max_size=4)
    bodies = st.dictionaries(keys, json_values | st.lists(parts, max_size=3) |
                             st.lists(st.fixed_dictionaries({"role": json_values, "content": json_values |
                                                              st.lists(parts, max_size=3)}), max_size=3), max_size=5)

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True, database=None)  # no .hypothesis/
    @hypothesis.given(bodies)
    def check(body):
        r = PrefixRouter(2)
        assert isinstance(prompt_text(body), str)
        assert r.choose(body)[0] in (0, 1)

    check()
    assert prompt_text({"messages": [{"role": "user", "content": [{"type": "text", "text": {}}]}]}) == "user:"
