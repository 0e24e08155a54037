"""Rewriting logprob token pieces after their content was sanitized."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from governance.sanitizer.core import Sanitizer

# --- logprobs: token pieces of sanitized text --------------------------------------------------

def fix_logprobs(new_body: Any, old_body: Any, sanitizer: Sanitizer) -> None:
    """Token strings in logprobs spell the content they belong to, a piece at a time; when the
    content was changed, the tokens overlapping a replaced span are rewritten (the first gets the
    replacement, the rest become empty) so no piece of the value survives. List lengths stay."""
    for _new_holder, _old_holder, text_new, text_old, tokens_new in _logprob_sites(
            new_body, old_body):
        if text_new == text_old or not isinstance(tokens_new, list):
            continue
        pieces = [t.get("token", "") if isinstance(t, dict) else "" for t in tokens_new]
        if "".join(pieces) != text_old:
            # Tokens do not spell the content: sanitize each piece on its own (patterns only).
            for t in tokens_new:
                if isinstance(t, dict) and isinstance(t.get("token"), str):
                    t["token"] = sanitizer.sanitize_text(t["token"]).text
                    _set_bytes(t)
            continue
        changed = _diff_regions(text_old, text_new)
        offset = 0
        for t, piece in zip(tokens_new, pieces, strict=True):
            start, end = offset, offset + len(piece)
            offset = end
            for (a, b, repl) in changed:
                if start < b and a < end:
                    new_token = repl if a >= start else ""
                    if a >= start:
                        new_token = piece[:a - start] + repl
                    if b <= end and a >= start:
                        new_token += piece[b - start:]
                    elif b <= end:
                        new_token = piece[b - start:]
                    t["token"] = new_token
                    _set_bytes(t)
                    for alt in t.get("top_logprobs") or []:
                        if isinstance(alt, dict):
                            alt["token"] = new_token
                            _set_bytes(alt)
                    break


def _set_bytes(t: dict) -> None:
    if "bytes" in t and t["bytes"] is not None:
        t["bytes"] = list(t["token"].encode())


def _diff_regions(old: str, new: str) -> list[tuple[int, int, str]]:
    import difflib

    out = []
    sm = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag != "equal":
            out.append((i1, max(i2, i1 + 1), new[j1:j2]))
    return out


def _logprob_sites(new: Any, old: Any) -> Iterable[tuple[Any, Any, Any, Any, Any]]:
    if not isinstance(new, dict):
        return
    for i, choice in enumerate(new.get("choices") or []):
        if not isinstance(choice, dict) or not isinstance(choice.get("logprobs"), dict):
            continue
        old_choice = old["choices"][i]
        msg_new = choice.get("message") or choice.get("delta") or {}
        msg_old = old_choice.get("message") or old_choice.get("delta") or {}
        if isinstance(msg_new, dict) and isinstance(msg_new.get("content"), str):
            yield (choice, old_choice, msg_new["content"], msg_old.get("content"),
                   choice["logprobs"].get("content"))
        elif isinstance(choice.get("text"), str):
            lp = choice["logprobs"]
            if isinstance(lp.get("tokens"), list):
                tokens = [{"token": t} for t in lp["tokens"]]
                yield (choice, old_choice, choice["text"], old_choice.get("text"), tokens)
                lp["tokens"] = [t["token"] for t in tokens]
    for j, item in enumerate(new.get("output") or []):
        if not isinstance(item, dict):
            continue
        for k, part in enumerate(item.get("content") or []):
            if isinstance(part, dict) and isinstance(part.get("logprobs"), list):
                old_part = old["output"][j]["content"][k]
                yield (part, old_part, part.get("text"), old_part.get("text"), part["logprobs"])


