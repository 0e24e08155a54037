"""Request rewrites of the evolution control plane, exactly as the proxy applies them and as the
gates replay them (trainer/evolution.py), so a gate judges what a canary serves: a context
update's system-prompt snippet or tool definitions, and where a canary route sends a request.
Pure functions on the parsed JSON body, no Django."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from wire.engines import EngineError, validate_http_url


def _append_text(content: Any, snippet: str) -> Any:
    if isinstance(content, str):
        return f"{content}\n\n{snippet}" if content else snippet
    if isinstance(content, list):
        return [*content, {"type": "text", "text": snippet}]
    return snippet


def apply_system_prompt(endpoint: str, body: dict, snippet: str) -> bool:
    """Append the snippet to the (first) system message, or insert one when there is none.
    Chat: `messages`; Responses: `instructions`. Legacy completions have no system prompt."""
    if endpoint == "chat.completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return False
        for i, message in enumerate(messages):
            if isinstance(message, dict) and message.get("role") == "system":
                messages[i] = {**message,
                               "content": _append_text(message.get("content"), snippet)}
                return True
        body["messages"] = [{"role": "system", "content": snippet}, *messages]
        return True
    if endpoint == "responses":
        instructions = body.get("instructions")
        body["instructions"] = _append_text(instructions, snippet) \
            if isinstance(instructions, str) else snippet
        return True
    return False


def apply_tool_schema(endpoint: str, body: dict, tools: dict[str, dict]) -> bool:
    """Replace the definition (description/parameters/strict) of every function tool named in
    `tools` that the request carries; tools are never added. True when one was rewritten."""
    listed = body.get("tools")
    if endpoint not in ("chat.completions", "responses") or not isinstance(listed, list):
        return False
    changed = False
    out = []
    for tool in listed:
        if isinstance(tool, dict) and tool.get("type", "function") == "function":
            fn = tool.get("function")
            if isinstance(fn, dict) and fn.get("name") in tools:  # chat shape
                tool = {**tool, "function": {**fn, **tools[fn["name"]], "name": fn["name"]}}
                changed = True
            elif "function" not in tool and tool.get("name") in tools:  # Responses shape
                tool = {**tool, **tools[tool["name"]], "name": tool["name"]}
                changed = True
        out.append(tool)
    if changed:
        body["tools"] = out
    return changed


def apply_context_update(endpoint: str, body: dict, kind: str, content: Any) -> bool:
    """Apply one context update (its `kind` and `content`) to the body in place; True when it
    changed the body. `system_prompt`: content["snippet"]; `tool_schema`: content["tools"]."""
    if not isinstance(content, dict):
        return False
    if kind == "system_prompt" and isinstance(content.get("snippet"), str):
        return apply_system_prompt(endpoint, body, content["snippet"])
    if kind == "tool_schema" and isinstance(content.get("tools"), dict):
        return apply_tool_schema(endpoint, body, content["tools"])
    return False


def upstream_parts(url: str) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, path prefix) of a candidate upstream URL; None for one the URL
    check (wire/engines.py) refuses."""
    try:
        parts = urlsplit(validate_http_url(url))
    except EngineError:
        return None
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, parts.hostname or "", port, parts.path.rstrip("/")
