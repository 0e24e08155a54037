"""`python manage.py sanitize [--tenant SLUG]`: JSONL in, JSONL out (DESIGN.md).

One OpenAI request or response body per input line; one `{"body": ..., "findings": [...]}` per
line out, in order. A line that is not a JSON object yields `{"error": "...", "line": N}` and
the exit code is 1; nothing is dropped. Without --tenant the default policy is used and no
database query is made (the command works without a running appliance). Input is read and
sanitized in batches, so large inputs are streamed, not loaded whole.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from django.core.management.base import BaseCommand, CommandError

BATCH_LINES = 64


def _kind(body: dict[str, Any]) -> str:
    """Responses carry an `object` (chat.completion, text_completion, response, ...) or
    `choices`/`output`; requests do not."""
    if "object" in body or "choices" in body or "output" in body:
        return "response"
    return "request"


class Command(BaseCommand):
    help = "Sanitize OpenAI request/response bodies: JSONL on stdin, JSONL on stdout."
    # No system checks: they are not needed to sanitize and must not touch the database.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tenant", help="tenant slug whose policy to apply "
                            "(default: the built-in policy, no database access)")
        parser.add_argument("--batch", type=int, default=BATCH_LINES,
                            help="lines per sanitizer batch (default %(default)s)")

    def handle(self, *args, **options) -> None:
        from governance.sanitizer import get_sanitizer, policy_for_tenant

        sanitizer = get_sanitizer()
        if options.get("tenant"):
            from governance.management.commands._common import get_tenant

            sanitizer = sanitizer.with_policy(policy_for_tenant(get_tenant(options["tenant"])))
        batch = max(1, int(options["batch"]))
        stdin: IO[str] = getattr(self, "_stdin", None) or sys.stdin
        out = self.stdout
        errors = 0
        pending: list[tuple[int, Any]] = []  # (line number, body or error message)

        def flush() -> None:
            nonlocal errors
            bodies = [(i, b) for i, b in pending if isinstance(b, dict)]
            results = iter(sanitizer.sanitize_bodies([(_kind(b), b) for _, b in bodies]))
            for lineno, item in pending:
                if isinstance(item, dict):
                    r = next(results)
                    record: dict[str, Any] = {"body": r.body, "findings": r.findings}
                else:
                    errors += 1
                    record = {"error": item, "line": lineno}
                out.write(json.dumps(record, ensure_ascii=False), ending="\n")
            out.flush()
            pending.clear()

        for lineno, line in enumerate(stdin, start=1):
            if not line.strip():
                pending.append((lineno, "empty line: expected a JSON object"))
            else:
                try:
                    value = json.loads(line)
                except ValueError as exc:
                    pending.append((lineno, f"invalid JSON: {exc}"))
                else:
                    pending.append((lineno, value if isinstance(value, dict) else
                                    f"expected a JSON object, got {type(value).__name__}"))
            if len(pending) >= batch:
                flush()
        if pending:
            flush()
        if errors:
            raise CommandError(f"{errors} line(s) could not be sanitized", returncode=1)
