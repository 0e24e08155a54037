"""Helpers for tests of the capture pipeline: spool records as the proxy writes them (the
contract in wire/spool.py's readers), shipping them with the real shipper and building steps
with the real task, in-process."""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path
from typing import Any

from governance.keyring import master_key
from proxy.spool import SpoolWriter


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def body_bytes(value: Any) -> bytes:
    if value is None:
        return b""
    return value if isinstance(value, bytes) else json.dumps(value).encode()


def make_record(tenant_id: int, agent_id: int, *, endpoint: str = "chat.completions",
                request: Any = None, response: Any = None, status: int | None = 200,
                stream: bool = False, session: str | None = None, subject: str | None = None,
                consent: str = "train", trajectory_id: str | None = None,
                source: str = "new", error: dict | None = None, t: float | None = None,
                flow_id: str | None = None) -> dict:
    """One spool record, exactly in the proxy's shape."""
    t = time.time() if t is None else t
    if request is None:
        request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = body_bytes(request)
    resp = None if response is None else body_bytes(response)
    path = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions",
            "responses": "/v1/responses"}.get(endpoint, "/v1/other")
    return {
        "v": 1,
        "flow_id": flow_id or uuid.uuid4().hex,
        "proxy_instance": "test:0",
        "tenant_id": tenant_id, "agent_id": agent_id, "proxy_key_id": 1,
        "trajectory_id": trajectory_id or str(uuid.uuid4()),
        "trajectory_source": source,
        "step_id": str(uuid.uuid4()),
        "session_id": session,
        "subject": subject,
        "consent": consent,
        "endpoint": endpoint,
        "method": "POST", "path": path,
        "request_headers": [["content-type", "application/json"], ["x-test", "1"]],
        "request_body": b64(req),
        "request_is_json": not isinstance(request, bytes),
        "response_status": status,
        "response_headers": None if response is None else [
            ["content-type", "text/event-stream" if stream else "application/json"]],
        "response_body": None if resp is None else b64(resp),
        "is_stream": stream,
        "error": error,
        "t_request": t, "t_first_byte": t + 0.05, "t_end": t + 0.2,
    }


def chat_response(content: str = "hello", *, rid: str | None = None,
                  tool_calls: list | None = None) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return {"id": rid or f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
            "model": "m-1", "choices": [{"index": 0, "message": msg,
                                         "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}


def write_records(spool_dir: Path, records: list[dict]) -> None:
    """Append records through the real SpoolWriter and close it (segment renamed .log)."""
    writer = SpoolWriter(spool_dir, master_key(), batch_ms=5)
    for r in records:
        writer.append(r)
    writer.close()


def ship_and_build(spool_dir: Path, records: list[dict]) -> dict:
    """Write, ship (no broker) and build the steps in-process; returns the shipper counts."""
    from governance.capture.shipper import ship_once
    from governance.tasks import build_steps

    write_records(spool_dir, records)
    collected: list[int] = []
    counts = ship_once(spool_dir, enqueue=collected.extend)
    # on_commit callbacks run at once outside a transaction; inside a test's transaction
    # (pytest-django `db`) they never fire, so build what the shipper inserted directly.
    from governance.models import Interaction

    ids = collected or list(Interaction.objects.filter(pending__state="captured")
                            .values_list("pk", flat=True))
    if ids:
        build_steps(ids)
    return counts


CUSTOMERS = ("Customer record: Maria Garcia, maria.garcia@example.com, +1 415 555 0142. "
             "Also on file: Peter Novak, peter.novak@example.org, +44 20 7946 0018.")


def customer_session(tenant_id: int, agent_id: int, trajectory_id: str,
                     subject: str | None = None) -> list[dict]:
    """Two calls of one session about customers (CUSTOMERS in the history, a person and an
    email in the first answer, a new email in the second call's appended message)."""
    history = [{"role": "system", "content": "You look up customers."},
               {"role": "user", "content": CUSTOMERS}]
    first = make_record(tenant_id, agent_id, trajectory_id=trajectory_id, subject=subject,
                        request={"model": "m", "messages": history},
                        response=chat_response("Found Maria Garcia (maria.garcia@example.com)."))
    second = make_record(tenant_id, agent_id, trajectory_id=trajectory_id, subject=subject,
                         request={"model": "m", "messages": history + [
                             {"role": "assistant", "content": "Which one?"},
                             {"role": "user", "content": "Email dana.white@example.net"}]},
                         response=chat_response("ok"), t=first["t_request"] + 1)
    return [first, second]


def packed_values_text(trajectory_ids: list[str] | None = None) -> str:
    """What the columns stored compressed hold, as JSON text, for leak checks that search the
    database: conversation items' content (packed JSON, decisions 40 and 61) and a step's action,
    usage, timings and versions (packed against a preset dictionary, decision 60). A dump or
    `row_to_json` shows these as bytes, where a leaked value would not be found. Read as the
    superuser outside any scope; every trajectory when `trajectory_ids` is None."""
    from django.db import connection

    from governance.models import AnswerRef, ItemJSONField, StepJSONField

    def item(content: Any) -> Any:
        value = ItemJSONField.unpack(content)
        # A reference to the answer it repeats (decision 62): the answer is the step's action,
        # searched below.
        if isinstance(value, AnswerRef):
            return {"answer_of_step": str(value.step_id), "message": value.index}
        return value

    where, params = ("", []) if trajectory_ids is None else (
        " WHERE trajectory_id::text = ANY(%s)", [[str(t) for t in trajectory_ids]])
    values: list[Any] = []
    with connection.cursor() as cur:
        cur.execute("SELECT content FROM governance_conversationitem" + where, params)
        values += [item(content) for (content,) in cur.fetchall()]
        cur.execute("SELECT action, usage, timings, versions FROM governance_step" + where,
                    params)
        values += [[StepJSONField.unpack(v) for v in row] for row in cur.fetchall()]
    return "\n".join(json.dumps(v, ensure_ascii=False) for v in values)
