"""`python manage.py sanitize` contract (DESIGN.md): JSONL in, JSONL out, in order, one output
line per input line, malformed lines -> {"error", "line"} and exit code 1. Run as a real
subprocess; without --tenant it must not need a database (DATABASE_URL points nowhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UNREACHABLE_DB = "postgresql://nobody@127.0.0.1:9/no_such_database"


def run_sanitize(lines: list[str], *args: str, env: dict | None = None) -> tuple[int, list, str]:
    proc = subprocess.run(
        [sys.executable, "manage.py", "sanitize", *args],
        input="".join(line + "\n" for line in lines), capture_output=True, text=True,
        cwd=ROOT, timeout=240,
        env={**os.environ, "DATABASE_URL": UNREACHABLE_DB, **(env or {})},
    )
    out = [json.loads(line) for line in proc.stdout.splitlines()]
    return proc.returncode, out, proc.stderr


def test_order_errors_and_nothing_dropped():
    bodies = []
    for i in range(7):
        bodies.append(json.dumps({"model": "m", "messages": [
            {"role": "user", "content": f"Message {i}: mail user{i}@example.com"}]}))
    lines = bodies[:3] + ["{not json", "[1, 2]", ""] + bodies[3:] + [json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "finish_reason": "stop",
             "message": {"role": "assistant", "content": "Call +44 20 7946 0958"}}]})]
    # --batch 2: several batches, errors in the middle of one; order must hold across them.
    rc, out, stderr = run_sanitize(lines, "--batch", "2")
    assert rc == 1, stderr
    assert len(out) == len(lines)
    for n, record in enumerate(out, start=1):
        line = lines[n - 1]
        if n in (4, 5, 6):
            assert set(record) == {"error", "line"} and record["line"] == n
        else:
            assert set(record) == {"body", "findings"}
            original = json.loads(line)
            assert record["body"].keys() == original.keys()
    i = 0
    for record in out:
        if "body" in record and "messages" in record["body"]:
            content = record["body"]["messages"][0]["content"]
            assert content == f"Message {i}: mail <EMAIL_ADDRESS_1>"
            assert record["findings"][0]["entity_type"] == "EMAIL_ADDRESS"
            i += 1
    assert i == 7
    assert out[-1]["body"]["choices"][0]["message"]["content"] == "Call <PHONE_NUMBER_1>"
    assert "7946" not in json.dumps(out)


def test_clean_input_exits_zero():
    rc, out, stderr = run_sanitize([json.dumps({"model": "m", "prompt": "Order ORD-1234 v1.2.3"})])
    assert rc == 0, stderr
    assert out == [{"body": {"model": "m", "prompt": "Order ORD-1234 v1.2.3"}, "findings": []}]


@pytest.mark.django_db(transaction=True)
def test_tenant_policy(tenant, settings):
    db = settings.DATABASES["default"]
    url = f"postgresql://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    body = json.dumps({"model": "m", "prompt": "I am Maria Garcia"})
    rc, out, stderr = run_sanitize([body], "--tenant", tenant.slug, env={"DATABASE_URL": url})
    assert rc == 0, stderr
    assert out[0]["body"]["prompt"] == "I am <PERSON_1>"
    rc, out, stderr = run_sanitize([body], "--tenant", "no-such-tenant",
                                   env={"DATABASE_URL": url})
    assert rc != 0 and "unknown tenant" in stderr
