"""OpenAI's structured-output fields on top of the engine's grammar constraint (engine/constraints.py):
`response_format` (json_object, json_schema), `tools` with `tool_choice`, the tool-call text and its parser, and
`logprobs` in OpenAI's two shapes (chat and completions).

How each tool_choice is served:
- "none": the tools are described to the model, the reply is plain text.
- "auto" (the default with tools): the tools are described in a system message together with the call format
      <tool_call>{"name": ..., "arguments": {...}}</tool_call>
  and the reply is parsed: a reply made of such blocks becomes `tool_calls` (finish_reason "tool_calls").
- "required" / {"type": "function", "function": {"name": ...}}: decoding is constrained to a JSON call (an array
  of 1..8 calls with parallel_tool_calls, else one call) whose arguments follow each function's JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from k3serve.errors import RequestError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_PARALLEL_CALLS = 8
_TOOL_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


@dataclass(frozen=True)
class OutputPlan:
    """What a chat request's output must be, decided once from its fields."""

    schema: dict | bool | None = None  # constrain decoding to this JSON schema (True: any JSON object)
    forced_tools: bool = False  # the constrained output is a tool call (or an array of them)
    parse_tools: bool = False  # tool_choice auto: look for <tool_call> blocks in the text
    tool_prompt: str | None = None  # the system text that describes the tools

    @property
    def uses_tools(self) -> bool:
        return self.forced_tools or self.parse_tools


def _call_schema(function: dict) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def plan_output(response_format: dict | None, tools: list[dict] | None, tool_choice: Any,
                parallel_tool_calls: bool) -> OutputPlan:
    """The output plan of a chat request (fields already validated by serve/protocol.py)."""
    schema: dict | bool | None = None
    if response_format is not None:
        kind = response_format["type"]
        if kind == "json_object":
            schema = True
        elif kind == "json_schema":
            schema = response_format["json_schema"].get("schema")
            if schema is None:  # never unconstrained prose for a request that asked for a schema
                raise RequestError("response_format.json_schema.schema is missing: give the JSON Schema the reply "
                                   "must follow")
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice needs tools")
        return OutputPlan(schema=schema)
    functions = [tool["function"] for tool in tools]
    prompt = tool_system_prompt(functions)
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return OutputPlan(schema=schema, tool_prompt=prompt)
    if choice == "auto":
        if schema is not None:  # a response format constrains the text: no free-form tool call can appear
            return OutputPlan(schema=schema, tool_prompt=prompt)
        return OutputPlan(parse_tools=True, tool_prompt=prompt)
    if schema is not None:
        raise RequestError("response_format cannot be combined with a forced tool_choice")
    if choice == "required":
        one = {"anyOf": [_call_schema(f) for f in functions]} if len(functions) > 1 else _call_schema(functions[0])
    else:
        name = choice["function"]["name"]
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise RequestError(f"tool_choice names '{name}', which is not among the tools")
        one = _call_schema(chosen[0])
    if parallel_tool_calls and choice == "required":
        one = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
    return OutputPlan(schema=one, forced_tools=True, tool_prompt=prompt)


def tool_system_prompt(functions: list[dict]) -> str:
    described = "\n".join(json.dumps(f, sort_keys=True) for f in functions)
    return ("You may call these functions:\n" + described + "\nTo call one, reply with "
            + TOOL_CALL_OPEN + '{"name": <function name>, "arguments": <arguments object>}' + TOOL_CALL_CLOSE
            + " (one block per call) and nothing else.")


def _as_tool_call(call: Any) -> dict | None:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    arguments = call["arguments"]
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": call["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def parse_tool_calls(text: str, plan: OutputPlan) -> list[dict] | None:
    """The OpenAI `tool_calls` of a reply, or None when the reply is plain content."""
    if plan.forced_tools:
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None  # cut short (max_tokens): the text is returned as content
        calls = [_as_tool_call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        return calls if calls and all(calls) else None
    if not plan.parse_tools:
        return None
    blocks = _TOOL_BLOCK.findall(text)
    if not blocks or _TOOL_BLOCK.sub("", text).strip():
        return None  # no call, or calls mixed with prose: keep it as content
    calls = []
    for block in blocks:
        try:
            calls.append(_as_tool_call(json.loads(block)))
        except json.JSONDecodeError:
            return None
    return calls if all(calls) else None


def render_tool_calls(tool_calls: list[dict]) -> str:
    """An assistant message's tool_calls as the text the model would have written (for the chat history)."""
    out = []
    for call in tool_calls:
        function = call.get("function", {})
        try:
            arguments = json.loads(function.get("arguments", "{}"))
        except (json.JSONDecodeError, TypeError):
            arguments = function.get("arguments")
        out.append(TOOL_CALL_OPEN + json.dumps({"name": function.get("name"), "arguments": arguments})
                   + TOOL_CALL_CLOSE)
    return "".join(out)


# ---- logprobs ---------------------------------------------------------------------------------------------------
def _token_text(tokenizer, token: int) -> str:
    return tokenizer.id_to_bytes(token).decode("utf-8", errors="replace")


def chat_logprobs(tokenizer, entries: list, top: int) -> dict:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}."""
    def item(token: int, logprob: float) -> dict:
        return {"token": _token_text(tokenizer, token), "logprob": logprob,
                "bytes": list(tokenizer.id_to_bytes(token))}

    content = []
    for entry in entries:
        row = item(entry.token, entry.logprob)
        row["top_logprobs"] = [item(t, lp) for t, lp in entry.top[:top]]
        content.append(row)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer, entries: list, top: int, offset: int = 0) -> dict:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs (token -> logprob), text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for entry in entries:
        text = _token_text(tokenizer, entry.token)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        tops.append({_token_text(tokenizer, t): lp for t, lp in entry.top[:top]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
