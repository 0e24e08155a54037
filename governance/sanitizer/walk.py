"""The structure-aware walk over OpenAI bodies: which strings are content and how."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from governance import recognizers as R

# --- the walk ----------------------------------------------------------------------------------

# String values under these keys are structure, not content: kept as they are.
STRUCTURAL_KEYS = frozenset({
    "id", "object", "model", "role", "type", "finish_reason", "status", "call_id",
    "tool_call_id", "previous_response_id", "system_fingerprint", "service_tier",
    "encrypted_content", "detail", "format", "reasoning_effort", "effort", "voice", "mime_type",
    "media_type", "tool_choice", "stop", "truncation", "prompt_cache_key", "item_id",
    "response_id", "response_format", "modalities", "parallel_tool_calls", "file_id",
    "logit_bias", "verbosity", "sequence_number", "output_index", "content_index",
    "incomplete_details", "annotations_type", "language", "generation_id", "stop_reason",
    "matched_stop", "finish_type", "event", "code", "param",
})
# String values under these keys are prose written by a person, a tool or the model.
TEXT_KEYS = frozenset({
    "content", "text", "prompt", "instructions", "input", "output", "refusal",
    "reasoning_content", "reasoning", "delta", "summary", "description", "suffix", "thinking",
    "transcript", "message", "title", "query", "result", "error", "body", "comment", "note",
    "notes", "question", "answer", "system",
})
BINARY_KEYS = frozenset({"data", "file_data", "b64_json", "audio", "image", "partial_image_b64"})
SUBJECT_KEYS = frozenset({"user", "safety_identifier", "end_user", "user_id"})
# Dicts whose "name" is a function/tool name, not a person.
_FUNCTION_PARENTS = frozenset({"function", "function_call", "custom", "tool", "mcp_call",
                               "custom_tool_call"})

_PROSE = re.compile(r"[A-Za-z][a-z]+[\s,.;:!?]+\S")
_NAME_SHAPE = re.compile(
    rf"[{R.UP}][{R.UP}{R.LO}'’\-]*(?:[ \t]+[{R.UP}{R.LO}][{R.UP}{R.LO}'’.\-]*){{0,4}}")


@dataclass(eq=False)
class _Embedded:
    """A JSON document inside a string (tool-call arguments, a JSON tool result)."""

    container: Any
    key: Any
    doc: Any
    compact: bool
    changed: bool = False


@dataclass(eq=False)
class _Slot:
    item: int
    container: Any
    key: Any
    text: str
    mode: str  # full | regex | name | secret | subject
    path: str
    value_path: str | None = None
    embedded: _Embedded | None = None
    spans: list[R.Span] = field(default_factory=list)
    ner: list[R.Span] = field(default_factory=list)
    blockers: list[tuple[int, int]] = field(default_factory=list)


def _key_path(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key)}]"


class _Walker:
    """Collects the slots (strings to sanitize) of one body, in document order."""

    def __init__(self, item: int, slots: list[_Slot], embedded: list[_Embedded]):
        self.item = item
        self.slots = slots
        self.embedded = embedded

    def walk(self, node: Any, path: str, key: Any = None, parent: dict | None = None,
             structured: bool = False, value_path: str | None = None,
             emb: _Embedded | None = None) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(v, str):
                    self._string(node, k, v, path, node, structured, value_path, emb)
                elif isinstance(v, int | float) and not isinstance(v, bool):
                    self._number(node, k, v, path, value_path, emb)
                elif isinstance(v, dict | list):
                    if k in ("logprobs", "top_logprobs") and not structured:
                        continue  # token pieces: fixed after the content (see _fix_logprobs)
                    if not structured and k in ("usage", "logit_bias", "response_format",
                                                "tool_choice", "token_ids", "tokens"):
                        continue
                    sub_vp = _key_path(value_path, k) if value_path else None
                    sub_p = path if value_path else _key_path(path, k)
                    self.walk(v, sub_p, k, node, structured or k == "metadata", sub_vp, emb)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                sub_vp = _key_path(value_path, i) if value_path else None
                sub_p = path if value_path else _key_path(path, i)
                if isinstance(v, str):
                    self._string(node, i, v, path, parent, structured, value_path, emb,
                                 list_key=key)
                elif isinstance(v, dict | list):
                    self.walk(v, sub_p, key, parent, structured, sub_vp, emb)

    def _add(self, container, key, text, mode, path, value_path, emb) -> None:
        self.slots.append(_Slot(self.item, container, key, text, mode, path, value_path, emb))

    def _string(self, container, key, value: str, path: str, parent, structured: bool,
                value_path: str | None, emb, list_key: Any = None) -> None:
        if isinstance(key, int):
            spath = path if value_path else _key_path(path, key)
            svp = _key_path(value_path, key) if value_path else None
            name = list_key if isinstance(list_key, str) else ""
        else:
            spath = path if value_path else _key_path(path, key)
            svp = _key_path(value_path, key) if value_path else None
            name = key
        if not value.strip():
            return
        if structured:
            self._structured_string(container, key, value, spath, svp, emb, name)
            return
        if name in STRUCTURAL_KEYS or (name in BINARY_KEYS and _looks_binary(value)):
            return
        if name == "name":
            if isinstance(container, dict) and (
                    "arguments" in container or "parameters" in container
                    or container.get("type") in _FUNCTION_PARENTS
                    or path.endswith((".function", ".function_call"))):
                return  # a function/tool name
            self._add(container, key, value, "name", spath, svp, emb)
            return
        if name in SUBJECT_KEYS:
            self._add(container, key, value, "subject", spath, svp, emb)
            return
        if name == "arguments":
            if self._embed(container, key, value, spath):
                return
            self._add(container, key, value, "full", spath, svp, emb)
            return
        if name in ("content", "output", "text", "result") and value.lstrip()[:1] in "{[":
            if self._embed(container, key, value, spath):
                return
        if name in ("url", "image_url", "file_url"):
            if not value.startswith("data:"):
                self._add(container, key, value, "regex", spath, svp, emb)
            return
        if name in TEXT_KEYS:
            self._add(container, key, value, _text_mode(value), spath, svp, emb)
            return
        self._add(container, key, value, _text_mode(value, unknown=True), spath, svp, emb)

    def _number(self, container: dict, key: str, value: int | float, path: str,
                value_path: str | None, emb) -> None:
        """A JSON number under a key that says what it is ({"age": 73}, {"zip": 94107},
        {"birth_year": 1961}): the value is that entity, replaced by a placeholder string.
        Other numbers (counts, prices, temperatures) are not text and stay as they are."""
        keyed = R.keyed_entity(key)
        if keyed is None:
            return
        spath = path if value_path else _key_path(path, key)
        svp = _key_path(value_path, key) if value_path else None
        self._add(container, key, json.dumps(value), f"keyed:{keyed}", spath, svp, emb)

    def _structured_string(self, container, key, value, spath, svp, emb, name: str) -> None:
        words = R.key_words(name) if name else ""
        keyed = R.keyed_entity(name) if name else None
        if R.SECRET_KEYS.search(words) and not R.working_directory(words, value):
            self._add(container, key, value, "secret", spath, svp, emb)
        elif name and R.PERSON_KEYS.match(words):
            self._add(container, key, value, "name", spath, svp, emb)
        elif keyed is not None:
            self._add(container, key, value, f"keyed:{keyed}", spath, svp, emb)
        elif name in SUBJECT_KEYS:
            self._add(container, key, value, "subject", spath, svp, emb)
        elif name in BINARY_KEYS and _looks_binary(value):
            return
        elif value.lstrip()[:1] in "{[" and emb is None and self._embed(
                container, key, value, spath):
            return
        else:
            self._add(container, key, value, _text_mode(value, unknown=True), spath, svp, emb)

    def _embed(self, container, key, value: str, spath: str) -> bool:
        try:
            doc = json.loads(value)
        except ValueError:
            return False
        if not isinstance(doc, dict | list):
            return False
        emb = _Embedded(container, key, doc, compact=", " not in value and ": " not in value)
        self.embedded.append(emb)
        self.walk(doc, spath, None, None, True, "$", emb)
        return True


_BASE64 = re.compile(r"[A-Za-z0-9+/=_\-\r\n]+")


def _looks_binary(value: str) -> bool:
    """A payload (base64, a data: URL) rather than text someone wrote: text under a key such as
    `data` (a tool result {"data": "..."}) is still sanitized."""
    return value.startswith("data:") or (len(value) >= 64 and bool(_BASE64.fullmatch(value)))


def _text_mode(value: str, unknown: bool = False) -> str:
    if len(value) < 3:
        return "skip"
    if " " not in value and "\n" not in value:
        # One token: an id, an enum, a URL, a single word — patterns only, no NER.
        return "regex"
    # NER where a name could be: prose, lower-case prose too ("follow up with patricia
    # desrosiers" is a name the gazetteer rules find).
    return "full" if _PROSE.search(value) else "regex"


