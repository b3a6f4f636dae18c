"""Every field of each API's official request schema, and what the gateway does with it: the
request models honour a field, or it is refused here with a 400 naming it and saying why.
A field in neither (a typo, a field from another API) is refused as unknown: nothing is
accepted and ignored. A field sent as null counts as left out, as in the official APIs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

NO_TOOLS = "tool and function calling are not supported by this gateway"
NOT_STORED = "this gateway stores no completions"

# Refused fields: the reason, and the values that ask for nothing (accepted as such).
Refusals = Mapping[str, tuple[str, tuple[Any, ...]]]

OPENAI_CHAT_REFUSED: Refusals = {
    "tools": (NO_TOOLS, ([],)),
    "tool_choice": (NO_TOOLS, ("none",)),
    "parallel_tool_calls": (NO_TOOLS, ()),
    "functions": (NO_TOOLS, ([],)),
    "function_call": (NO_TOOLS, ("none",)),
    "response_format": (
        "structured output (json_object, json_schema) is not supported; only text",
        ({"type": "text"},),
    ),
    "audio": ("audio output is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "prediction": ("predicted outputs are not supported", ()),
    "reasoning_effort": ("the served model does not reason; leave reasoning_effort out", ()),
    "verbosity": ("verbosity is not supported; use max_completion_tokens", ()),
    "web_search_options": ("web search is not supported", ()),
    "moderation": ("moderation is not part of this gateway", ()),
    "store": (NOT_STORED, (False,)),
    "metadata": (f"metadata tags stored completions; {NOT_STORED}", ({},)),
    "service_tier": ("this gateway has one service tier", ("auto", "default")),
    "prompt_cache_key": ("prefix caching here is automatic, by shared prompt prefix", ()),
    "prompt_cache_options": ("prefix caching here is automatic, by shared prompt prefix", ()),
    "prompt_cache_retention": ("cached prefixes live as long as the cache has room", ()),
    "stream_options.include_obfuscation": ("stream obfuscation is not supported", (False,)),
}

OPENAI_COMPLETIONS_REFUSED: Refusals = {
    "suffix": ("insertion (suffix) is not supported", ("",)),
    "best_of": ("best_of is not supported; use n", (1,)),
    "stream_options.include_obfuscation": ("stream obfuscation is not supported", (False,)),
}

NO_ANTHROPIC_TOOLS = "tool use is not supported by this gateway"
ANTHROPIC_REFUSED: Refusals = {
    "tools": (NO_ANTHROPIC_TOOLS, ([],)),
    "tool_choice": (NO_ANTHROPIC_TOOLS, ({"type": "none"},)),
    "thinking": (
        "extended thinking is not supported (the served model does not think)",
        ({"type": "disabled"},),
    ),
    "output_config": ("output_config (effort, structured output) is not supported", ({},)),
    "container": ("code execution containers are not supported", ()),
    "mcp_servers": ("MCP servers are not supported", ([],)),
    "context_management": ("context management is not supported", ()),
    "cache_control": ("prefix caching here is automatic, by shared prompt prefix", ()),
    "inference_geo": ("this gateway runs where it is deployed", ()),
    "speed": ("this gateway has one speed", ()),
    "diagnostics": ("diagnostics are not supported", ()),
    "workspace_id": ("this gateway has no workspaces", ()),
    "user_profile_id": ("this gateway has no user profiles; use metadata.user_id", ()),
    "service_tier": ("this gateway has one service tier", ("auto", "standard_only")),
}


def refuse(data: Any, honoured: set[str], refused: Refusals) -> None:
    """ValueError naming the first field that is refused or unknown."""
    if not isinstance(data, dict):
        return
    for name, value in data.items():
        if value is None or name in honoured:
            continue
        if name in refused:
            reason, neutral = refused[name]
            if value not in neutral:
                raise ValueError(f"{name}: {reason}")
            continue
        raise ValueError(f"{name}: unknown field; see the API reference for the fields it takes")
    options = data.get("stream_options")
    if isinstance(options, dict):
        nested = {f"stream_options.{k}": v for k, v in options.items()}
        refuse(nested, {"stream_options.include_usage"}, refused)


def no_lone_surrogates(value: Any, where: str = "body") -> None:
    """ValueError for a string holding a lone UTF-16 surrogate (a JSON "\\ud800" escape with no
    pair): it is not Unicode text, no tokenizer or response can carry it."""
    if isinstance(value, str):
        if any("\ud800" <= ch <= "\udfff" for ch in value):
            raise ValueError(f"{where}: holds a lone UTF-16 surrogate escape; send valid Unicode")
    elif isinstance(value, dict):
        for key, item in value.items():
            no_lone_surrogates(key, where)
            no_lone_surrogates(item, f"{where}.{key}" if where != "body" else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            no_lone_surrogates(item, f"{where}[{i}]")
