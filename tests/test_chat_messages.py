"""One check for a conversation (nanospec.chat_messages), used by LLM.chat and the server alike: what one refuses
the other refuses, with the same message (the server's side: test_serve.py)."""

import pytest

from nanospec import LLM, SamplingParams
from nanospec.chat_messages import check_messages
from tiny import make_tiny_llama


def test_a_conversation_becomes_plain_messages():
    """As vLLM hands a conversation to the template: text parts joined by newlines, a message's name kept."""
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]
    assert check_messages([{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": parts, "name": "ann"}]) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nyou", "name": "ann"}]


@pytest.mark.parametrize("messages, message", [
    ([], "messages: give at least one message"),
    (None, "messages: give at least one message"),
    (["hi"], "messages[0]: a message is an object"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role: must be one of 'system', 'developer', 'user'"),
    ([{"content": "hi"}], "messages[0].role: must be one of"),
    ([{"role": "user", "content": "hi"}, {"role": "user"}], "messages[1].content: missing"),
    ([{"role": "user", "content": None}], "messages[0].content: missing"),
    ([{"role": "user", "content": 5}], "messages[0].content: must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "messages[0].content[0]: a part is"),
    ([{"role": "user", "content": "hi", "tool_calls": []}], "messages[0]: unknown field 'tool_calls'"),
    ([{"role": "user", "content": "hi", "name": 3}], "messages[0].name: must be a string"),
])
def test_what_is_refused(messages, message):
    with pytest.raises(ValueError) as error:
        check_messages(messages)
    assert str(error.value).startswith(message)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_messages")
    make_tiny_llama(path, layers=1, max_pos=128)
    return LLM(str(path), num_blocks=32, block_size=4)


def test_llm_chat_refuses_before_any_work(llm):
    params = SamplingParams(max_tokens=2)
    for bad in ([], [{"role": "wizard", "content": "hi"}], [{"role": "user"}]):
        with pytest.raises(ValueError):
            llm.chat(bad, params)
        with pytest.raises(ValueError):
            llm.stream_chat(bad, params)
    with pytest.raises(ValueError, match=r"messages\[1\]\[0\].role: must be one of"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "wizard", "content": "hi"}]], params)
    assert not llm.engine.has_unfinished() and llm.kv_cache_stats()["free_blocks"] == 32
    (one,) = llm.chat([{"role": "user", "content": "hi"}], params)
    two = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "ho"}]], params)
    assert len(one.outputs[0].token_ids) == 2 and len(two) == 2
