"""serve/tool_stream.py: tool calls streamed character by character add up to the non-streamed parse."""

from __future__ import annotations

import pytest

from k3serve.serve.structured import parse_tool_calls, plan_output
from k3serve.serve.tool_stream import ToolCallStreamer

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
FORCED = plan_output(None, [TOOL], "required", True)
AUTO = plan_output(None, [TOOL], None, True)


def _stream(text: str, plan, reason: str = "stop") -> tuple[list[tuple[str, str]], str, str | None]:
    """(calls as (name, arguments), content, finish_reason) a client accumulates, fed one character a step."""
    streamer = ToolCallStreamer(plan)
    deltas = [delta for char in text for delta in streamer.add(char)]
    last, reason = streamer.finish(reason)
    calls: dict[int, list[str]] = {}
    for delta in deltas + last:
        assert not (delta.content and delta.tool_calls)
        for call in delta.tool_calls:
            if "id" in call:
                assert call["index"] not in calls and call["function"]["arguments"] == ""
                calls[call["index"]] = [call["function"]["name"], ""]
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)], "".join(d.content for d in deltas + last), reason


@pytest.mark.parametrize("text, plan", [
    (('[{"name":"f","arguments":{"a":[1, 2.50,{"b":"x\\u00e9\\"y"}],"c":true,"d":null,"e":1e3,"f":-0}},'
      ' {"arguments": {}, "name": "f"}]'), FORCED),
    ('{"name": "f", "arguments": "already a string"}', FORCED),
    ((' <tool_call>{"arguments": {"q": [ ]}, "name": "f"}</tool_call>\n<tool_call>{"name":"f","arguments":{}}'
      '</tool_call>\n'), AUTO),
])
def test_streamed_calls_add_up_to_the_parsed_reply(text, plan):
    calls, content, reason = _stream(text, plan)
    parsed = [(c["function"]["name"], c["function"]["arguments"]) for c in parse_tool_calls(text, plan)]
    assert calls == parsed and content == "" and reason == "tool_calls"


@pytest.mark.parametrize("text, plan, reason", [
    ('{"name": "f", "arguments": {"a": 1', FORCED, "length"),  # cut short by max_tokens
    ('{"name": "f", "arguments": {"a": 1}}', FORCED, "length"),  # whole, yet the non-streamed reply is content
    ("<tool_call>{\"name\": \"f\", \"arguments\": {x}}</tool_call>", AUTO, "stop"),
    ("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call> and prose", AUTO, "stop"),
    ("prose, then <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", AUTO, "stop"),
    ("<tool_c", AUTO, "stop"),
])
def test_a_reply_that_is_no_call_ends_with_all_its_text_as_content(text, plan, reason):
    assert parse_tool_calls(text, plan) is None or reason != "stop"
    _, content, finish_reason = _stream(text, plan, reason)
    assert content == text and finish_reason == reason


def test_leading_whitespace_and_a_partial_marker_are_held_and_prose_is_not():
    streamer = ToolCallStreamer(AUTO)
    assert streamer.add("\n <tool_") == []
    assert [d.content for d in streamer.add("x")] == ["\n <tool_x"]
    assert [d.content for d in streamer.add(" more")] == [" more"]
