"""Long agent sessions through the real appliance, against the same new content as one-off calls.

    .venv/bin/python tests/bench/long_sessions.py [--shapes 10,60,200] [--sessions 2]
        [--new-kb 3 | --context-kb 100] [--corpus generated|presidio-research|tau-bench]
        [--recorded-sessions N] [--inferred]
        [--paced-shape 60] [--stream] [--clock-in-system] [--window-kb K] [--repeat N]
        [--api chat|responses] [--quick]

An agent resends its whole conversation with every call. This bench measures what that costs the
appliance as it is: the real proxy (`mitmdump -s proxy/addon.py`), the real shipper
(`manage.py ship_spool`) and the real Celery worker (`-Q capture,sanitize,celery -c 2`), each
started with the command line `steward up` uses (config.cli.service_argv), with the official
`openai` client talking to the proxy. The upstream is a small local OpenAI-compatible server (in
this process) whose "model" always answers with a tool call, so that every turn of a session
appends what agents append: the assistant's reply with its tool_calls, then the tool's result.

Bodies: a ~2 KB system prompt, five tool schemas, a first user message, then per turn the
assistant's tool call (arguments carry an email from the last tool result) and a tool result of
customer records with personal data (names, emails, phones, postal addresses, notes; planted with
tests/bench/corpus.py's generator), about `--new-kb` of new content per call. `--context-kb K`
instead sizes each shape's new content so that its last call carries about K KB of context.
`--corpus presidio-research` takes the first user message and the tool results (support notes)
from text nobody here wrote instead: presidio-research's synthetic PII sentences
(tests/bench/data/synth_dataset_v2.json, MIT), consecutive from a seeded offset.
`--corpus tau-bench` replaces the generated sessions with recorded ones: tau-bench's 200
GPT-4o airline customer-service sessions (tests/bench/data/tau_bench_gpt4o_airline.json.gz, MIT;
a simulated customer, the agent's own 6 KB policy prompt and 14 tools, real tool results with
profiles, reservations and payment methods, text answers as well as tool calls, 2-30 calls a
session). The upstream answers each call with the message the model answered it with then, and
the sessions are sent as they were, `--sessions` agents at once, each working through its share
one session after another; sessions with a turn that another has word for word but answered
otherwise are left out (the upstream answers by the turn). The shape, the session and one-off
modes and every figure are as for generated sessions; the time, database and rate targets are
for the generated 60- and 200-call shapes and are not marked for recorded sessions. With
`--api responses` the recorded sessions go as a stateless Responses API agent sends them (below);
the upstream finds each recorded answer from the input items.

For each shape (calls per session) and `--sessions` sessions sent concurrently (each session by
its own thread, a call as soon as the previous one was answered):
  session   every call resends the whole conversation, with `X-Steward-Session`;
  inferred  (with --inferred) the same without the header: the proxy infers the trajectory;
  one-off   the baseline: the SAME new messages, each call carrying only the system prompt, the
            tools and that turn's new messages (its own X-Steward-Session, so that only the
            resent history differs from the session run).
Every run starts with a fresh worker (stopped and started again, the time until it says ready not
counted): every run sends the same new content, and a worker that had seen it would answer its
strings from the sanitizer's detection cache (governance/sanitizing.py's AnalysisCache) instead of
analysing them — the second run of the same text measured that cache, not the pipeline. Per run it
prints the time from the first send until the last step exists (every interaction processed or
quarantined), the database growth (sum of pg_total_relation_size over every table of the app schema,
before/after; nothing is deleted between runs), the ATDP documents' bytes
(governance.capture.atdp.trajectory_document of each trajectory), database bytes per call against
the call's new content (JSON of the new messages, and at a conversation's first call its system
prompt and tool schemas: decision 63; the ratio against the new messages alone beside it), the
sustained calls/s (calls / time to sanitized) with step lag p50/p95 (step created_at - the proxy's
t_request), the time to open the raw payload of a session's last call cold (its delta chain read and
rebuilt; the worst of two sessions) with how many payloads are sealed whole, where a call's bytes go
(growth per call by table, the largest twelve), where the worker's time went (its log line per built
batch: batches, seconds by stage, delta chains started from the last opened call, strings whose
detection was cached), and the ratios session / one-off.
`--clock-in-system` ends the system prompt with the date, time and turn of the call, so the
first message of a session changes at every call (agents that put the date or a memory block
in their system prompt); in every mode.
`--window-kb K` keeps a session's requests under K KB of messages: past that, each call drops the
oldest turns after the first user message (coding and support agents that keep a context budget
send this), so every call's history is a truncation of the previous one's, not an extension.
`--window-drops-first` makes it a pure sliding window: the first user message goes too once the
window is full (LangChain's trim_messages(strategy="last")), so without X-Steward-Session no
stored conversation state is a prefix of a later call (`--inferred`: proxy inference rule 4).
`--repeat N` runs each shape's modes N times (each repetition's modes back to back, in turn
first) and shows the repetition whose session / one-off time ratio is the median, printing every
repetition's ratio: on two cores shared by the agent, the proxy, the shipper and the worker, the
same 60-call command read 1.03x and 1.55x in two runs of one evening (the batches the workers
happen to form, which process idles).
Beside each run, the agent alone: the same calls sent straight to the upstream (no proxy)
by the same client, timed — what the agent spends building and sending its requests
whatever sits between it and the model (the openai client's request building grows with a
long message list) — and the time to sanitized beyond it. Then the NER floor: spaCy (the
sanitizer's model, loaded as the sanitizer loads it) over just the new text of the same calls,
as calls/s (the fastest of three passes), next to the pipeline's sustained rate.
`--stream` streams every call of every mode (SSE, usage included; the agent assembles the tool
call from the chunks), the way most agents call their model.
`--api responses` sends the same conversations to the Responses API as a stateless agent does
(the OpenAI Agents SDK's default, `store: false`): the whole input every call, the model's
output items (its message and `function_call`) echoed back, each tool result a
`function_call_output`, the system prompt as `instructions`. With `--inferred` it measures proxy
inference rule 3b (decision 54).
`--paced-shape N` (default 60 when 60 is among the shapes) runs that shape's sessions once more,
paced at `--paced-fraction` of the sustained rate just measured, and reports the lag p95 at that
rate (target, issue 16: < 5 s).
`--backlog-shape N` (default 60 when 60 is among the shapes) runs that shape's sessions and
one-off calls once more each with the worker stopped until every call is sent and shipped, then
started: the time from its ready to the last step, and calls / that time, are the pipeline's
own, with the work waiting and the agent's sending out of them (the session rate printed
against the NER floor, which the 60-call target is judged by; both runs' drain times and
worker CPU side by side). A live run's
calls / time to sanitized cannot pass the agent's own sending rate, whatever the pipeline
does: 120 calls of 200 KB took the bench's openai client 1.6-3.1 s to send.

Targets (issue 16): time and database growth <= 1.2x the one-off figure at 60 calls, <= 1.5x at
200 calls with 100 KB contexts; database bytes per call <= 3x the call's new content; sustained
calls/s at 60 calls within 1.5x of the NER floor. The table marks each. The exit status is 0 when
every call of every run became a step (whatever the targets), 1 otherwise; `--strict` makes a
missed target exit 2.

Needs PostgreSQL and Redis, nothing set: the server is DATABASE_URL's (default
postgresql://postgres@127.0.0.1:5432), reached through its `postgres` maintenance database, where
a throwaway database steward_bench_<pid> is created, migrated and dropped at the end (`--keep`
keeps it); Redis is CELERY_BROKER_URL when that is a redis:// URL, else redis://127.0.0.1:6379/0,
every key of the run under a prefix of its own (tests/bench/sanitize_pipeline.py's settings shim)
and only those keys deleted afterwards. A clear error when either is unreachable. Logs of the
proxy, shipper and worker are kept in a temporary directory when a run fails.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.bench.sanitize_pipeline import (  # noqa: E402
    SETTINGS_SHIM,
    drop_run_state,
    percentile,
    stop_processes,
    with_db,
)
from tests.bench.sanitize_pipeline import cpu_seconds as process_cpu  # noqa: E402

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
MODEL = "bench-agent-model"
MODES = ("one-off", "session", "inferred")
BACKLOG_MODES = ("one-off", "session")
# Issue 16's targets: session / one-off ratio of time and database growth by shape, bytes of
# database per call against its new content, sustained rate against the NER floor, lag p95.
RATIO_TARGETS = {60: 1.2, 200: 1.5}
BYTES_PER_NEW_BYTE_TARGET = 3.0

FLOOR_FACTOR_TARGET = 1.5
LAG_P95_TARGET_S = 5.0


def new_content_per_call(run: dict) -> float:
    """A call's new content, as the bytes-per-new-byte target counts it (decision 63): what it
    sent or was answered that no earlier call of its conversation carried — its new messages,
    and at a conversation's first call its system prompt and tool schemas too (a one-off call
    is its own conversation: all of it is new)."""
    return run["new_bytes_per_call"] + run["opening_bytes_per_call"]

# --- the agent's bodies (pure) -----------------------------------------------------------------

SYSTEM_RULES = [
    "You are the customer-care agent of Northwind Outfitters, an online retailer of outdoor gear "
    "that ships to the UK, the EU and North America.",
    "Always look the customer up with lookup_customer before you discuss an order, a refund or "
    "an address; never guess an account from a name alone.",
    "Confirm the customer's identity with two of: email, phone number, postal code, the last "
    "four digits of the card on file. Do not read the full card number back.",
    "Refunds up to 150 EUR may be issued with issue_refund; above that, open a ticket for a "
    "supervisor and tell the customer the expected response time (one business day).",
    "Address changes are allowed until the order is handed to the carrier. After that, offer a "
    "carrier redirect through the carrier's own portal and explain the fee.",
    "When a tool result lists several customers, work through them in order and summarise each "
    "account in one or two sentences before acting on it.",
    "Keep answers short, factual and polite. Use the customer's preferred language when it is "
    "recorded on the account; otherwise answer in English.",
    "Never disclose one customer's data to another customer, and never paste internal notes "
    "verbatim: they may contain opinions of staff that are not meant for customers.",
    "If a customer asks for their data to be deleted, acknowledge the request, create a "
    "privacy ticket with send_email to privacy@northwind.example and stop processing.",
    "Orders flagged for fraud review must not be changed; explain that the order is being "
    "checked and that the customer will receive an email within 48 hours.",
    "Loyalty points: 1 point per EUR spent, 100 points are worth 5 EUR, points expire after "
    "24 months. Points cannot be paid out in cash.",
    "Returns: 30 days from delivery, 60 days for loyalty members; items must be unused with "
    "tags. Footwear worn outdoors cannot be returned, except for manufacturing defects.",
    "Warranty claims need a photo of the defect and the order number; create them with "
    "send_email to warranty@northwind.example, one email per item.",
    "Escalate threats, legal demands and press enquiries to a human immediately and do not "
    "comment on them.",
    "Before you end a conversation, summarise what was done and what the customer should "
    "expect next, with dates where there are any.",
]
SYSTEM_PROMPT = "\n".join(f"{i + 1}. {rule}" for i, rule in enumerate(SYSTEM_RULES))


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


_EMAIL = {"type": "string", "description": "The customer's email address as on the account."}
TOOLS = [
    _tool("lookup_customer", "Find customer accounts by email, phone or name; returns the "
          "matching accounts with contact details, addresses and recent notes.",
          {"email": _EMAIL, "phone": {"type": "string"}, "name": {"type": "string"}}, ["email"]),
    _tool("list_orders", "List the orders of a customer, newest first, with status and carrier.",
          {"email": _EMAIL, "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
          ["email"]),
    _tool("update_address", "Change the delivery address of an order not yet shipped.",
          {"email": _EMAIL, "order_id": {"type": "string"},
           "address": {"type": "string", "description": "Full postal address."}},
          ["email", "order_id", "address"]),
    _tool("issue_refund", "Refund an order or part of it to the original payment method.",
          {"email": _EMAIL, "order_id": {"type": "string"},
           "amount_eur": {"type": "number", "exclusiveMinimum": 0},
           "reason": {"type": "string", "enum": ["damaged", "late", "wrong_item", "other"]}},
          ["email", "order_id", "amount_eur", "reason"]),
    _tool("send_email", "Send an email from the support mailbox (tickets, confirmations).",
          {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
          ["to", "subject", "body"]),
]
_EMAIL_RE = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")


def content_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def assistant_for(last: dict) -> dict:
    """The upstream model's answer to a conversation whose last message is `last`: a call of
    one of the tools about the first email in that message. A pure function of `last`, so the
    one-off baseline can carry exactly the assistant message the session run appended."""
    text = content_text(last)
    digest = hashlib.sha256(text.encode()).hexdigest()
    tool = TOOLS[zlib.crc32(text.encode()) % len(TOOLS)]["function"]["name"]
    found = _EMAIL_RE.search(text)
    email = found.group(0) if found else "unknown@northwind.example"
    args: dict[str, Any] = {"email": email}
    if tool == "send_email":
        args = {"to": email, "subject": "Your request", "body": "We are looking into it."}
    elif tool in ("update_address", "issue_refund"):
        args["order_id"] = f"ORD-{int(digest[:6], 16)}"
        if tool == "issue_refund":
            args.update(amount_eur=round(int(digest[6:10], 16) % 15000 / 100, 2), reason="late")
        else:
            args["address"] = "see account"
    return {"role": "assistant", "content": f"Checking with {tool} for {email}.",
            "tool_calls": [{"id": f"call_{digest[:24]}", "type": "function",
                            "function": {"name": tool, "arguments": json.dumps(args)}}]}


def customer_record(g: Any) -> dict:
    name = g.person()
    # Not g.benign(): some of its tokens are dates relative to now, and the bodies must be the
    # same in every run.
    order = f"ORD-{g.rng.randint(1000, 99999999)}"
    return {"customer_id": f"C-{g.rng.randint(100000, 999999)}", "name": name,
            "email": g.value("EMAIL_ADDRESS", name), "phone": g.value("PHONE_NUMBER"),
            "address": g.en.address().replace("\n", ", "),
            "note": f"{g.sentence('PERSON', name)} {g.benign_sentence(order)}"}


def tool_message(g: Any, call: dict, size: int) -> dict:
    """The result of `call`: customer records until the content holds about `size` bytes (the
    last record loses its note, address and phone while the content stays at `size` or more, so
    that small sizes, e.g. --context-kb over 200 calls, are not rounded up to whole records)."""
    records: list[dict] = []

    def dump() -> str:
        return json.dumps({"tool": call["function"]["name"], "matches": len(records),
                           "customers": records})

    body = ""
    while not records or len(body) < size:
        records.append(customer_record(g))
        body = dump()
    for key in ("note", "address", "phone"):
        kept = records[-1].pop(key)
        if len(dump()) < size:
            records[-1][key] = kept
            break
    return {"role": "tool", "tool_call_id": call["id"], "content": dump()}


# --corpus presidio-research: tool results made of text nobody here wrote (presidio-research's
# synthetic PII sentences, MIT, tests/bench/data/README.md), in the order of the file.
PRESIDIO_SYNTH = REPO / "tests" / "bench" / "data" / "synth_dataset_v2.json"
TAU_BENCH = REPO / "tests" / "bench" / "data" / "tau_bench_gpt4o_airline.json.gz"
CORPORA = ("generated", "presidio-research", "tau-bench")


def presidio_texts() -> list[str]:
    """presidio-research's 1,500 `full_text`s, as the file has them."""
    return [row["full_text"] for row in json.loads(PRESIDIO_SYNTH.read_text())]


# --corpus tau-bench: the recorded model's answer to each turn, by turn_key (set by bench()).
RECORDED: dict[str, dict] = {}


def turn_key(messages: list[dict]) -> str:
    """What identifies a call's turn in its request, in every mode: the messages from its last
    assistant message on (the previous call's answer and what came after it), or after the
    system prompt when there is none yet. A session, a window and a one-off call all end with
    the same turn."""
    start = next((i for i in range(len(messages) - 1, -1, -1)
                  if messages[i].get("role") == "assistant"), None)
    if start is None:
        start = 1 if messages and messages[0].get("role") == "system" else 0
    return hashlib.sha256(json.dumps(messages[start:], sort_keys=True).encode()).hexdigest()


def answer_for(messages: list[dict]) -> dict:
    """The model's answer to a request: the recorded one (--corpus tau-bench), else the
    generator's tool call about the last message."""
    if RECORDED:
        return RECORDED[turn_key(messages)]
    return assistant_for(messages[-1])


@dataclass
class Recorded:
    """Sessions recorded from a real agent, as long_sessions replays them."""

    system: str
    tools: list[dict]
    sessions: list[list[list[dict]]]  # each a script: the new messages of each call
    kept: list[int]  # which recorded session each is (its index in the file)
    answers: dict[str, dict]  # turn_key -> the recorded answer
    left_out: int  # sessions with a turn another session has word for word, answered otherwise
    source: str


def recorded_sessions(limit: int = 0) -> Recorded:
    """tau-bench's 200 recorded GPT-4o airline customer-service sessions (a simulated customer,
    the agent with its 14 tools and real tool results: profiles with names, emails, addresses,
    dates of birth, payment methods, reservations). Each assistant message is one call: its
    request is everything before it, its turn the messages since the previous answer, and the
    upstream answers with the recorded message. What follows a session's last answer (the
    customer's goodbye) is no call. A session with a turn that an earlier one has word for word
    but answered otherwise is left out: the upstream answers by the turn (12 of 200 here,
    repeated openings of the same task). `limit`: the first this many sessions kept."""
    import gzip

    data = json.loads(gzip.decompress(TAU_BENCH.read_bytes()))
    systems = {t["traj"][0]["content"] for t in data["trajectories"]}
    if len(systems) != 1:
        raise SystemExit(f"{TAU_BENCH.name}: expected one system prompt, found {len(systems)}")
    answers: dict[str, dict] = {}
    sessions: list[list[list[dict]]] = []
    kept: list[int] = []
    left_out = 0
    for index, t in enumerate(data["trajectories"]):
        messages = t["traj"][1:]
        at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not at or at[0] == 0:
            left_out += 1
            continue
        turns = [messages[b:e] for b, e in zip([0, *at], at, strict=False)]
        keyed = {turn_key(turn): messages[e] for turn, e in zip(turns, at, strict=True)}
        if len(keyed) < len(turns) or any(answers.get(k, a) != a for k, a in keyed.items()):
            left_out += 1
            continue
        answers.update(keyed)
        sessions.append(turns)
        kept.append(index)
        if limit and len(sessions) == limit:
            break
    return Recorded(system=systems.pop(), tools=data["tools"], sessions=sessions, kept=kept,
                    answers=answers, left_out=left_out, source=data["source"])


def notes_message(texts: list[str], start: int, call: dict, size: int) -> tuple[dict, int]:
    """The result of `call` as a support tool returns notes: corpus texts `start`, `start + 1`,
    ... (wrapping around) until the content holds about `size` bytes; returns the message and
    the next text's index."""
    notes: list[dict] = []

    def dump() -> str:
        return json.dumps({"tool": call["function"]["name"], "matches": len(notes),
                           "notes": notes})

    i = start
    while not notes or len(dump()) < size:
        notes.append({"id": f"N-{i % len(texts)}", "text": texts[i % len(texts)]})
        i += 1
    return {"role": "tool", "tool_call_id": call["id"], "content": dump()}, i


def message_bytes(messages: list[dict]) -> int:
    return len(json.dumps(messages).encode())


def script(seed: int, calls: int, new_bytes: int, corpus: str = "generated"
           ) -> list[list[dict]]:
    """The new messages of each call of one session: call 0 a user message, call k >= 1 the
    assistant's answer to call k-1 (assistant_for) and the result of the tool it called.
    `corpus` "presidio-research": the user message and the tool results are that corpus's
    texts (from a seeded offset) instead of the generator's customer records."""
    if corpus == "presidio-research":
        texts = presidio_texts()
        start = random.Random(seed).randrange(len(texts))
        first = {"role": "user", "content": "Please go through the notes of these customers "
                 "and fix what you can. The first one: " + texts[start]}
        turns = [[first]]
        last, nxt = first, start + 1
        for _ in range(1, calls):
            reply = assistant_for(last)
            size = max(200, new_bytes - message_bytes([reply]))
            last, nxt = notes_message(texts, nxt, reply["tool_calls"][0], size)
            turns.append([reply, last])
        return turns
    from tests.bench.corpus import Gen

    g = Gen(seed)
    name = g.person()
    first = {"role": "user", "content": (
        f"Hi, this is {name} ({g.value('EMAIL_ADDRESS', name)}, {g.value('PHONE_NUMBER')}). "
        "Several orders of our family accounts have not arrived; please check every account "
        "that comes up and fix what you can.")}
    turns = [[first]]
    last = first
    for _ in range(1, calls):
        reply = assistant_for(last)
        size = max(200, new_bytes - message_bytes([reply]))
        last = tool_message(g, reply["tool_calls"][0], size)
        turns.append([reply, last])
    return turns


def new_texts(messages: list[dict]) -> list[str]:
    """The text a sanitizer reads in new messages: contents and tool-call arguments."""
    texts = [content_text(m) for m in messages]
    for m in messages:
        texts += [c["function"]["arguments"] for c in m.get("tool_calls") or []]
    return [t for t in texts if t]


# --clock-in-system: the system prompt ends with the time of the call (set by bench()).
CLOCK_IN_SYSTEM = False


def system_message(k: int) -> dict:
    """Call k's system message: SYSTEM_PROMPT, and with --clock-in-system the date and time and
    the turn after it, as agents that put the date (or a memory block) in their system prompt
    send it — a session's first message then differs at every call."""
    content = SYSTEM_PROMPT
    if CLOCK_IN_SYSTEM:
        now = datetime.fromtimestamp(1_764_979_200 + 37 * k, UTC)
        content += f"\n\nCurrent date and time: {now:%A %d %B %Y, %H:%M:%S} UTC. Turn {k + 1}."
    return {"role": "system", "content": content}


# --window-kb: a session's requests keep at most this many KB of messages (set by bench());
# --window-drops-first: the first user message is not kept either.
WINDOW_KB = 0.0
WINDOW_DROPS_FIRST = False


def request_messages(turns: list[list[dict]], k: int, mode: str) -> list[dict]:
    """What call k sends: the system prompt plus, in a session, every message so far; one-off,
    only call k's new messages. With --window-kb, a session drops its oldest turns after the
    first user message until the messages fit the window, as agents that keep their context
    under a budget do (the history then no longer extends the previous call's: a truncation at
    every call once the window is full)."""
    if mode == "one-off":
        return [system_message(k), *turns[k]]
    first, rest = 1, k + 1
    if WINDOW_KB and k >= first:
        kept = [] if WINDOW_DROPS_FIRST else turns[0]
        budget = int(WINDOW_KB * 1024) - message_bytes([system_message(k), *kept])
        floor = 0 if WINDOW_DROPS_FIRST else first
        sizes = [message_bytes(t) for t in turns[:k + 1]]
        start, size = k, sizes[k]
        while start > floor and size + sizes[start - 1] <= budget:
            start -= 1
            size += sizes[start]
        if start == 0:  # everything fits: the first user message is still there
            return [system_message(k), *[m for t in turns[:rest] for m in t]]
        return [system_message(k), *kept, *[m for t in turns[start:rest] for m in t]]
    return [system_message(k), *[m for t in turns[:rest] for m in t]]


# --api responses: the same conversations on the Responses API (set by bench()).
API = "chat"


def responses_tools() -> list[dict]:
    """TOOLS (the generator's, or the recorded agent's) as Responses API function tools."""
    return [{"type": "function", **t["function"]} for t in TOOLS]


def answer_tag(answer: dict) -> str:
    """What a chat answer's Responses ids are made of: its first call id, else its text's
    hash, so the agent's echo of them is the same in every mode and run."""
    calls = answer.get("tool_calls") or []
    if calls:
        return calls[0]["id"].removeprefix("call_")
    return hashlib.sha256((answer.get("content") or "").encode()).hexdigest()[:24]


def output_items(answer: dict) -> list[dict]:
    """A chat answer as the Responses API's output items: its text as an assistant message,
    then each tool call as a `function_call` (answer_tag's ids)."""
    tag = answer_tag(answer)
    items: list[dict] = []
    if answer.get("content"):
        items.append({"type": "message", "id": f"msg_{tag}", "status": "completed",
                      "role": "assistant", "content": [
                          {"type": "output_text", "text": answer["content"], "annotations": []}]})
    for call in answer.get("tool_calls") or []:
        items.append({"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}",
                      "status": "completed", "call_id": call["id"],
                      "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"]})
    return items


def responses_input(messages: list[dict]) -> tuple[str | None, list[dict]]:
    """Chat messages as a stateless Responses API agent (the OpenAI Agents SDK, `store:
    false`) sends them: the system prompt as `instructions`, the model's answers as the output
    items it got back, each tool result as a `function_call_output`."""
    instructions, items = None, []
    for m in messages:
        if m["role"] == "system":
            instructions = m["content"]
        elif m["role"] == "assistant":
            items += output_items(m)
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return instructions, items


# --corpus tau-bench --api responses: the recorded answer to each turn, by items_turn_key.
RECORDED_ITEMS: dict[str, dict] = {}


def _is_answer_item(item: dict) -> bool:
    return item.get("type") == "function_call" or item.get("role") == "assistant"


def items_turn_key(items: list[dict]) -> str:
    """turn_key for Responses input: the items from the first output item of the last answer
    (its message and function calls) on, else all of them (the instructions are apart)."""
    start = next((i for i in range(len(items) - 1, -1, -1) if _is_answer_item(items[i])), None)
    while start is not None and start > 0 and _is_answer_item(items[start - 1]):
        start -= 1
    return hashlib.sha256(json.dumps(items[start or 0:], sort_keys=True).encode()).hexdigest()


def recorded_items_answers(recorded: Recorded) -> dict[str, dict]:
    """items_turn_key -> the recorded answer, for every turn of the recorded sessions."""
    out: dict[str, dict] = {}
    system = {"role": "system", "content": recorded.system}
    for turns in recorded.sessions:
        for turn in turns:
            key = items_turn_key(responses_input([system, *turn])[1])
            answer = recorded.answers[turn_key([system, *turn])]
            if out.setdefault(key, answer) != answer:
                raise SystemExit("--api responses: two recorded turns read the same as items")
    return out


def chat_message(item: dict) -> dict:
    """A Responses input item as the chat message assistant_for reads."""
    if item.get("type") == "function_call_output":
        return {"role": "tool", "content": item.get("output", "")}
    return {"role": item.get("role", "user"), "content": item.get("content", "")}


def new_kb_for(args: argparse.Namespace, calls: int) -> float:
    """New content per call: --new-kb, or what makes the last call carry --context-kb."""
    if not args.context_kb:
        return args.new_kb
    fixed = message_bytes([{"role": "system", "content": SYSTEM_PROMPT}]) + message_bytes(TOOLS)
    return max(0.3, (args.context_kb * 1024 - fixed) / calls / 1024)


# --- the upstream -------------------------------------------------------------------------------

def stream_chunks(whole: dict, include_usage: bool) -> list[dict]:
    """`whole` (a chat completion) as the chunks a model streams it in: the role, the content
    a few words at a time, each tool call's id and name, then its arguments in two pieces,
    the finish reason, and the usage when asked for."""
    message = whole["choices"][0]["message"]
    head = {k: whole[k] for k in ("id", "model")} | {"object": "chat.completion.chunk",
                                                      "created": 1}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    out = [chunk({"role": "assistant", "content": ""})]
    words = (message.get("content") or "").split(" ")
    for i in range(0, len(words), 4):
        out.append(chunk({"content": " ".join(words[i:i + 4]) + (" " if i + 4 < len(words)
                                                                  else "")}))
    for i, call in enumerate(message.get("tool_calls") or []):
        args = call["function"]["arguments"]
        out.append(chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                          "function": {"name": call["function"]["name"],
                                                       "arguments": ""}}]}))
        for part in (args[:len(args) // 2], args[len(args) // 2:]):
            out.append(chunk({"tool_calls": [{"index": i, "function": {"arguments": part}}]}))
    out.append(chunk({}, whole["choices"][0]["finish_reason"]))
    if include_usage:
        out.append({**head, "choices": [], "usage": whole["usage"]})
    return out


def upstream_app() -> Any:
    """An OpenAI-compatible chat endpoint answering answer_for(the messages): the generator's
    tool call about the last message, or the recorded answer to the turn (--corpus tau-bench),
    as one JSON document or, with `stream: true`, as server-sent events (stream_chunks)."""
    from aiohttp import web

    from tests.pipeline import chat_response

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        try:
            answer = answer_for(body["messages"])
        except KeyError:
            return web.json_response({"error": {"message": "no recorded answer to this turn",
                                                "type": "invalid_request_error"}}, status=400)
        whole = chat_response(answer.get("content"), tool_calls=answer.get("tool_calls"))
        if not body.get("stream"):
            return web.json_response(whole)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in stream_chunks(whole, bool((body.get("stream_options") or {})
                                               .get("include_usage"))):
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def responses(request: web.Request) -> web.Response:
        body = await request.json()
        try:
            answer = (RECORDED_ITEMS[items_turn_key(body["input"])] if RECORDED_ITEMS
                      else assistant_for(chat_message(body["input"][-1])))
        except KeyError:
            return web.json_response({"error": {"message": "no recorded answer to this turn",
                                                "type": "invalid_request_error"}}, status=400)
        return web.json_response({
            "id": f"resp_{answer_tag(answer)}", "object": "response", "created_at": 1,
            "status": "completed",
            "model": MODEL, "output": output_items(answer), "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": body.get("tools", []), "error": None,
            "incomplete_details": None, "instructions": body.get("instructions"),
            "metadata": {}, "temperature": 1.0, "top_p": 1.0,
            "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", models)
    return app


# --- the appliance ------------------------------------------------------------------------------

@dataclass
class Appliance:
    base_url: str
    tenant: Any
    keys: dict[str, str]  # agent name -> proxy key secret
    processes: dict[str, subprocess.Popen]
    tmp: Path
    upstream_url: str = ""  # the local upstream's /v1, for the agent-alone baseline
    warmup_s: float = 0.0
    failed: list[str] = field(default_factory=list)
    worker_argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    worker_restarts_s: list[float] = field(default_factory=list)

    @property
    def detection_cache(self) -> Path:
        return Path(self.env.get("STEWARD_DETECTION_CACHE_DIR")
                    or self.tmp / "var" / "detection-cache")

    def check_alive(self, skip: tuple[str, ...] = ()) -> None:
        dead = [n for n, p in self.processes.items() if n not in skip and p.poll() is not None]
        if dead:
            raise SystemExit(f"{', '.join(dead)} exited; logs in {self.tmp}")

    def restart_worker(self, timeout: float = 180) -> None:
        """A fresh worker (as `steward up` starts it) before a run, so that no run finds
        what an earlier one left in its processes: the sanitizer's detection cache
        (AnalysisCache) answers a string it analysed before, and every run sends the same
        new content as the others (the one-off baseline too). Back when it says ready."""
        t0 = time.monotonic()
        self.stop_worker()
        self.start_worker(timeout)
        self.worker_restarts_s.append(round(time.monotonic() - t0, 1))

    def stop_worker(self) -> None:
        stop_processes([self.processes["worker"]])
        # The detection cache the worker's processes share (SharedDetections) would answer
        # this run from the last one as surely as a process's own would: emptied too.
        shutil.rmtree(self.detection_cache, ignore_errors=True)

    def start_worker(self, timeout: float = 180) -> float:
        """Start the worker; back when its log says ready, with that time (time.time(),
        to within the 50 ms it polls at)."""
        log_path = self.tmp / "worker.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        with open(log_path, "ab") as log:
            self.processes["worker"] = subprocess.Popen(
                self.worker_argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            with open(log_path, "rb") as f:
                f.seek(offset)
                if re.search(rb"@\S+ ready\.", f.read()):
                    break
            self.check_alive()
            if time.monotonic() > deadline:
                raise SystemExit(f"the restarted worker was not ready in {timeout:.0f} s; "
                                 f"logs in {self.tmp}")
            time.sleep(0.05)
        return time.time()


def require_services(server: str, broker: str) -> None:
    """Fail early, and clearly, when PostgreSQL or Redis is not there."""
    import psycopg
    import redis

    try:
        psycopg.connect(server, connect_timeout=5, autocommit=True).close()
    except psycopg.Error as e:
        raise SystemExit(f"long_sessions: PostgreSQL is not reachable at {server} ({e}); "
                         "start it or pass --pg URL (the server's maintenance database)") from e
    try:
        redis.Redis.from_url(broker, socket_connect_timeout=5).ping()
    except redis.RedisError as e:
        raise SystemExit(f"long_sessions: Redis is not reachable at {broker} ({e}); start it "
                         "or pass --redis URL") from e


@contextmanager
def appliance(server: str, broker: str, agents: list[str], keep_db: bool = False
              ) -> Iterator[Appliance]:
    """A throwaway database on `server`, migrated; a tenant with one proxy key per agent name;
    the local upstream; proxy, shipper and worker as `steward up` starts them."""
    import psycopg

    from config.cli import ServiceConfig, service_argv

    run_id = f"{os.getpid()}"
    db_name = f"steward_bench_{run_id}"
    prefix = f"steward-bench-long-{uuid.uuid4().hex[:8]}:"
    tmp = Path(tempfile.mkdtemp(prefix="steward-bench-long-"))
    (tmp / "steward_bench_settings.py").write_text(SETTINGS_SHIM.format(prefix=prefix))
    env = {**os.environ, "DATABASE_URL": with_db(server, db_name),
           "CELERY_BROKER_URL": broker,
           "STEWARD_MASTER_KEY": base64.b64encode(os.urandom(32)).decode(),
           "STEWARD_VAR_DIR": str(tmp / "var"), "DJANGO_SETTINGS_MODULE": "steward_bench_settings",
           "PYTHONPATH": f"{REPO}{os.pathsep}{tmp}", "PYTHONUNBUFFERED": "1"}
    for name in ("DATABASE_OWNER_URL", "STEWARD_TEST_DATABASE", "STEWARD_MASTER_KEY_FILE",
                 "STEWARD_SPOOL_DIR", "STEWARD_DB_SCOPE_ROLE", "STEWARD_UPSTREAM_URL"):
        env.pop(name, None)
    with psycopg.connect(server, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db_name}"')
    processes: dict[str, subprocess.Popen] = {}
    worker_argv: list[str] = []
    stop_upstream: Callable[[], None] | None = None
    ok = False
    try:
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env,
                       check=True)
        os.environ.update({k: env[k] for k in ("DATABASE_URL", "CELERY_BROKER_URL",
                                               "STEWARD_MASTER_KEY", "STEWARD_VAR_DIR",
                                               "DJANGO_SETTINGS_MODULE")})
        for name in ("STEWARD_MASTER_KEY_FILE", "STEWARD_SPOOL_DIR", "STEWARD_DB_SCOPE_ROLE"):
            os.environ.pop(name, None)
        sys.path.insert(0, str(tmp))
        import django

        django.setup()
        for noisy in ("aiohttp.access", "httpx", "httpx2", "openai"):  # a line per call otherwise
            logging.getLogger(noisy).setLevel(logging.WARNING)
        from governance.services import create_proxy_key, create_tenant
        from tests.live import ProxyProcess, free_port, serve_app, wait_for_key, wait_for_port

        tenant = create_tenant("system:bench", "bench", "Bench")[0]
        keys = {a: create_proxy_key("system:bench", tenant, a).secret for a in agents}
        upstream, stop_upstream = serve_app(upstream_app())
        cfg = ServiceConfig(var_dir=tmp / "var", host="127.0.0.1", web_port=0,
                            proxy_port=free_port(), upstream=upstream)
        for name in ("proxy", "shipper", "worker"):
            argv = service_argv(name, cfg, single_host=True)
            if name == "worker":
                argv += ["-n", f"bench-long-{run_id}@%h"]  # the last -n wins
                worker_argv = argv
            with open(tmp / f"{name}.log", "wb") as log:
                processes[name] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log,
                                                   stderr=subprocess.STDOUT)
        proxy = ProxyProcess(f"http://127.0.0.1:{cfg.proxy_port}", cfg.proxy_port,
                             tmp / "var" / "spool", tmp / "proxy.log", processes["proxy"], env)
        wait_for_port(cfg.proxy_port, timeout=60, process=processes["proxy"])
        for secret in keys.values():
            wait_for_key(proxy, secret)
        yield Appliance(proxy.base_url, tenant, keys, processes, tmp,
                        upstream_url=upstream.rstrip("/").removesuffix("/v1") + "/v1",
                        worker_argv=worker_argv, env=env)
        ok = True
    finally:
        stop_processes(list(processes.values()))
        if stop_upstream is not None:
            stop_upstream()
        drop_run_state(server, None if keep_db else db_name, broker, prefix)
        if keep_db:  # to open the kept database's payloads (a throwaway key of this run)
            print(f"long_sessions: kept database {db_name}, STEWARD_MASTER_KEY="
                  f"{env['STEWARD_MASTER_KEY']}", file=sys.stderr)
        if ok and not keep_db:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"long_sessions: logs kept in {tmp}", file=sys.stderr)


# --- measuring ----------------------------------------------------------------------------------

# The processes whose CPU a run adds up (cpu_seconds): the appliance's, and this one — the
# agent's openai client and the local upstream run in its threads.
CPU_PARTS = ("proxy", "shipper", "worker", "bench")


def cpu_seconds(app: Appliance) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each appliance process, its children
    included (the worker's prefork pool: sanitize_pipeline.cpu_seconds), and by this
    process. On 2 cores the parts compete: what the session run's agent and proxy use is not
    there for the worker."""
    out = {name: process_cpu(app.processes[name].pid) for name in CPU_PARTS[:-1]}
    out["bench"] = time.process_time()  # this process alone (its children are the appliance)
    return out


def table_sizes() -> dict[str, int]:
    """pg_total_relation_size (heap, TOAST, indexes) of every table of the app's schema:
    partitions are plain tables there, a partitioned parent has no storage of its own."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'm')")
        return {name: int(size) for name, size in cur.fetchall()}


def built(app: Appliance, agent: str) -> tuple[int, int]:
    """(interactions shipped, interactions no longer waiting for their step) of one agent."""
    from governance.models import Interaction
    from governance.tenancy import tenant_context

    with tenant_context(app.tenant):
        qs = Interaction.objects.filter(agent__name=agent)
        return qs.count(), qs.exclude(pending__state=Interaction.State.CAPTURED).count()


def send_session(app: Appliance, agent: str, turns: list[list[dict]], mode: str,
                 due: Callable[[int], float] | None, direct: bool = False,
                 stream: bool = False) -> None:
    """One agent session with the openai client: call k sends request_messages(turns, k, mode)
    and must get back the answer that turns[k + 1] starts with, its first tool call (id and
    arguments) or its text (the proxy changed nothing).
    `direct`: to the upstream itself, not through the proxy (the agent-alone baseline).
    `stream`: each call streamed (`stream=True` with usage), the tool call assembled from the
    chunks as an agent does."""
    import openai

    client = openai.OpenAI(base_url=app.upstream_url if direct else app.base_url,
                           api_key="direct" if direct else app.keys[agent], max_retries=0,
                           timeout=300)
    session = f"bench-{uuid.uuid4().hex}"
    for k in range(len(turns)):
        if due is not None:
            time.sleep(max(0.0, due(k) - time.time()))
        headers = {"X-Steward-Session": session if mode == "session"
                   else f"bench-{uuid.uuid4().hex}"} if mode != "inferred" else {}
        messages = request_messages(turns, k, mode)
        want = reply_key(answer_for(messages))
        if API == "responses":
            instructions, items = responses_input(messages)
            reply = client.responses.create(model=MODEL, tools=responses_tools(),
                                            instructions=instructions, input=items, store=False,
                                            extra_headers=headers)
            first = next((o for o in reply.output if o.type == "function_call"), None)
            got = (("call", first.call_id, first.arguments) if first is not None
                   else ("text", reply.output_text))
        elif stream:
            got_id, arguments, text = None, "", ""
            for chunk in client.chat.completions.create(
                    model=MODEL, tools=TOOLS, extra_headers=headers, messages=messages,
                    stream=True, stream_options={"include_usage": True}):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
                    for piece in choice.delta.tool_calls or []:
                        got_id = piece.id or got_id
                        arguments += (piece.function.arguments or "") if piece.function else ""
            got = ("call", got_id, arguments) if got_id else ("text", text)
        else:
            reply = client.chat.completions.create(model=MODEL, tools=TOOLS,
                                                   extra_headers=headers, messages=messages)
            message = reply.choices[0].message
            first = (message.tool_calls or [None])[0]
            got = (("call", first.id, first.function.arguments) if first is not None
                   else ("text", message.content or ""))
        if got != want:
            raise RuntimeError(f"call {k}: the upstream's answer did not come back intact")


def reply_key(answer: dict) -> tuple:
    """What an agent reads of an answer: its first tool call (id, arguments), else its text."""
    calls = answer.get("tool_calls") or []
    if calls:
        return ("call", calls[0]["id"], calls[0]["function"]["arguments"])
    return ("text", answer.get("content") or "")


def send_share(app: Appliance, agent: str, sessions: list[list[list[dict]]], mode: str,
               due: Callable[[int], float] | None, **kw: Any) -> None:
    """One agent's sessions, one after another (send_session each); `due(c)`: when the
    agent's c-th call over all of them is due."""
    sent = 0
    for turns in sessions:
        send_session(app, agent, turns, mode,
                     None if due is None else (lambda k, base=sent: due(base + k)), **kw)
        sent += len(turns)


def agent_alone(app: Appliance, scripts: list[list[list[dict]]], mode: str,
                stream: bool = False, agents: int | None = None) -> float:
    """Seconds the same sessions take straight to the upstream, no proxy: what the agent
    itself spends (the openai client building and sending the requests, the upstream
    answering) and the appliance cannot take away. Sessions in threads, as `run` sends them."""
    errors: list[BaseException] = []
    agents = agents or len(scripts)

    def session(i: int) -> None:
        try:
            send_share(app, "", scripts[i::agents], mode, None, direct=True, stream=stream)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    t0 = time.time()
    threads = [threading.Thread(target=session, args=(i,)) for i in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"{mode} without the proxy: sending failed: {errors[0]!r}")
    return round(time.time() - t0, 2)


def run(app: Appliance, agent: str, scripts: list[list[list[dict]]], mode: str,
        rate: float | None, drain_timeout: float, fresh_worker: bool = True,
        stream: bool = False, backlog: bool = False, agents: int | None = None) -> dict:
    """Send `scripts` (one per concurrent session; with `agents`, that many agents at once,
    agent i sending sessions i, i + agents, ... one after another) as `mode`; wait until every
    call is a step.
    `rate`: calls/s over all sessions (None: each call as soon as the previous one answered).
    `fresh_worker`: restart the worker first (Appliance.restart_worker). `stream`: streamed
    calls (send_session). `backlog`: the worker is stopped while every call is sent and
    shipped, then started: `drain_s` is from its ready to the last step, the pipeline's own
    rate with all the work waiting (what it can sustain), not bounded by the agent's
    sending as the time to sanitized of a live run is."""
    import orjson

    from governance.capture.atdp import trajectory_document
    from governance.models import Step, Trajectory
    from governance.tenancy import tenant_context

    calls = sum(len(s) for s in scripts)
    if backlog:
        app.stop_worker()
    elif fresh_worker:
        app.restart_worker()
    before = table_sizes()
    cpu_before = cpu_seconds(app)
    worker_log = app.tmp / "worker.log"
    log_from = worker_log.stat().st_size if worker_log.exists() else 0
    errors: list[BaseException] = []
    t0 = time.time()

    agents = agents or len(scripts)

    def session(i: int) -> None:
        # Paced: the agents' calls interleave, call k of agent i at (k * A + i) / rate.
        due = None if rate is None else (lambda k: t0 + (k * agents + i) / rate)
        try:
            send_share(app, agent, scripts[i::agents], mode, due, stream=stream)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(agents)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent_s = time.time() - t0
    if errors:
        raise SystemExit(f"{mode}: sending failed: {errors[0]!r}; logs in {app.tmp}")
    ready = None
    if backlog:
        deadline = time.monotonic() + drain_timeout
        while built(app, agent)[0] < calls and time.monotonic() < deadline:
            app.check_alive(skip=("worker",))  # stopped on purpose
            time.sleep(0.1)
        ready = app.start_worker()
        # Its CPU from here: starting (the model loading) is not building.
        cpu_before["worker"] = process_cpu(app.processes["worker"].pid)
    deadline = time.monotonic() + drain_timeout
    while True:
        shipped, done = built(app, agent)
        if done >= calls or time.monotonic() > deadline:
            break
        app.check_alive()
        time.sleep(0.25)
    after = table_sizes()
    cpu_after = cpu_seconds(app)
    worker = worker_stages(worker_log, log_from, calls)
    cache_bytes = sum(f.stat().st_size for f in app.detection_cache.rglob("*") if f.is_file())
    with tenant_context(app.tenant):
        rows = list(Step.objects.filter(trajectory__agent__name=agent)
                    .values_list("created_at", "interaction__started_at"))
        trajectories = list(Trajectory.objects.filter(agent__name=agent)
                            .select_related("tenant", "agent"))
        atdp = sum(len(orjson.dumps(trajectory_document(t), default=str)) for t in trajectories)
        # ATDP's compact form (?form=compact: each step's history as parent + appended).
        atdp_compact = sum(len(orjson.dumps(trajectory_document(t, compact=True), default=str))
                           for t in trajectories)
        steps_per_trajectory = sorted(t.steps.count() for t in trajectories)
        open_ms, whole = raw_open_figures(trajectories)
    if len(rows) < calls:
        app.failed.append(f"{mode}/{agent}: {len(rows)} steps of {calls} calls "
                          f"({shipped} shipped)")
    last = max((r[0].timestamp() for r in rows), default=float("nan"))
    lags = [(c - s).total_seconds() for c, s in rows if s is not None]
    growth = {t: after.get(t, 0) - before.get(t, 0) for t in after}
    new_bytes = sum(message_bytes(turn) for s in scripts for turn in s)
    # What each conversation's first call also carries and no earlier call of it did: the
    # system prompt and the tool schemas, once per session (per call for one-off calls, each its
    # own conversation). Not in `new_bytes`: its call-by-call content is what the two modes
    # share; reported beside it, the target stays on `new_bytes`.
    openings = calls if mode == "one-off" else len(scripts)
    opening_bytes = openings * (message_bytes([system_message(0)]) + message_bytes(TOOLS))
    elapsed = last - t0
    drain = {} if ready is None else {
        "drain_s": round(last - ready, 2),
        "drain_calls_per_s": round(calls / (last - ready), 3) if last > ready else None}
    return {
        "mode": mode, "calls": calls, "steps": len(rows), "sent_s": round(sent_s, 2),
        "time_to_sanitized_s": round(elapsed, 2),
        "calls_per_s": round(calls / elapsed, 3) if elapsed > 0 else None,
        "lag_p50_s": round(statistics.median(lags), 2) if lags else None,
        "lag_p95_s": round(percentile(lags, 95), 2) if lags else None,
        "db_growth_bytes": sum(growth.values()),
        "db_growth_top": dict(sorted(growth.items(), key=lambda kv: -kv[1])[:12]),
        "atdp_bytes": atdp, "atdp_compact_bytes": atdp_compact,
        "trajectories": len(trajectories),
        "steps_per_trajectory": [steps_per_trajectory[0], steps_per_trajectory[-1]]
        if steps_per_trajectory else [],
        "new_bytes_per_call": round(new_bytes / calls),
        "opening_bytes_per_call": round(opening_bytes / calls),
        "db_bytes_per_call": round(sum(growth.values()) / calls),
        "rate": rate, "raw_open_last_ms": open_ms, "raw_whole_copies": whole,
        "worker": worker, "detection_cache_bytes": cache_bytes,
        "cpu_s": {k: round(cpu_after[k] - cpu_before.get(k, 0.0), 2) for k in cpu_after},
        **drain,
    }


# The worker's line per built batch (governance.tasks.StageClock) and per task's commit.
BATCH_LINE = re.compile(r"capture: tenant \d+: built (\d+) steps .*? in \d+ ms: (.*?) ms; "
                        r"(\d+) of (\d+) trajectories' last calls cached; "
                        r"(\d+) of (\d+) strings' detection cached \((\d+) shared\)")
COMMIT_LINE = re.compile(r"capture: built \d+ steps, .*; commit (\d+) ms")


def worker_stages(path: Path, offset: int, calls: int, wait_s: float = 5.0) -> dict:
    """What the worker's log says of this run's batches (from `offset` on): how many, their
    steps, and the seconds spent by stage, summed over the worker's processes (so they can
    pass the run's wall time). A batch logs after its commit, so the last line can follow the
    last step by a moment: read until the lines account for every call, or `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
        batches = list(BATCH_LINE.finditer(text))
        steps = sum(int(m.group(1)) for m in batches)
        if steps >= calls or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    stage_s: dict[str, float] = {}
    for m in batches:
        for part in m.group(2).split(", "):
            name, ms = part.rsplit(" ", 1)
            stage_s[name] = stage_s.get(name, 0.0) + int(ms) / 1000
    stage_s["commit"] = sum(int(m.group(1)) for m in COMMIT_LINE.finditer(text)) / 1000
    return {"batches": len(batches), "steps": steps,
            "stage_s": {k: round(v, 2) for k, v in stage_s.items()},
            "cached": sum(int(m.group(3)) for m in batches),
            "trajectory_batches": sum(int(m.group(4)) for m in batches),
            "analysis_hits": sum(int(m.group(5)) for m in batches),
            "analysed": sum(int(m.group(6)) for m in batches),
            "shared_hits": sum(int(m.group(7)) for m in batches)}


def worker_line(r: dict) -> str:
    """The run's builder batches and their seconds by stage, for the shape table."""
    w = r.get("worker") or {}
    if not w.get("batches"):
        return "-"
    stages = ", ".join(f"{k} {v:.2f}" for k, v in w["stage_s"].items())
    return (f"{w['batches']} batches of {w['steps'] / w['batches']:.1f} steps; s: {stages}; "
            f"cached chains {w['cached']}/{w['trajectory_batches']}, "
            f"detection {w['analysis_hits']}/{w['analysed']} "
            f"({w.get('shared_hits', 0)} from the shared cache)")


def raw_open_figures(trajectories: list) -> tuple[float | None, int]:
    """(ms to open the last call's raw payload of the longest trajectories, cold: its delta
    chain read and rebuilt as the console's raw view does; the worst of two), and how many of
    the run's payloads are sealed whole (no delta base). In the tenant scope."""
    from governance.capture.rawstore import delta_bases, open_raw
    from governance.models import Interaction

    ids = [t.pk for t in trajectories]
    whole = (Interaction.objects.filter(trajectory_id__in=ids, raw_ciphertext__isnull=False,
                                        raw_base_flow="").count())
    longest = sorted(trajectories, key=lambda t: -t.step_count)[:2]
    times = []
    for t in longest:
        last = (Interaction.objects.filter(trajectory=t, raw_ciphertext__isnull=False)
                .select_related("data_key").order_by("-started_at").first())
        if last is None:
            continue
        t0 = time.perf_counter()
        open_raw(last, {}, delta_bases([last]))
        times.append((time.perf_counter() - t0) * 1000)
    return (round(max(times), 1) if times else None), whole


def ner_floor(nlp: Any, scripts: list[list[list[dict]]], passes: int = 3) -> float:
    """Calls/s of spaCy NER alone over just the new text of the calls (batched as the
    sanitizer batches: nlp.pipe over the texts of many calls), the fastest of `passes` passes:
    a floor is what the model can do at best, and one pass on a shared 2-core machine moved
    by 1.7x between runs (23.9 and 40.9 calls/s over the same text)."""
    texts = [t for s in scripts for turn in s for t in new_texts(turn)]
    list(nlp.pipe(texts[:8]))  # warm
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for _ in nlp.pipe(texts, batch_size=64):
            pass
        best = min(best, time.perf_counter() - t0)
    return sum(len(s) for s in scripts) / best


# --- the bench ----------------------------------------------------------------------------------

def agent_name(shape: int, mode: str, paced: bool = False, backlog: bool = False,
               rep: int = 0) -> str:
    """The agent a run sends as: each run its own, so that its steps are counted apart."""
    return (f"bench-{shape}-{mode}{'-paced' if paced else ''}{'-backlog' if backlog else ''}"
            f"{f'-r{rep}' if rep else ''}")


def median_repetition(repeats: dict[str, list[dict]]) -> int:
    """Which repetition of a shape the table shows: the one whose session / one-off time
    ratio is the median (of an even count, the higher of the two middle ones). Each
    repetition's modes ran back to back, so their ratio is paired: a slower stretch of the
    shared machine moves both."""
    session, one_off = repeats["session"], repeats["one-off"]
    order = sorted(range(len(session)), key=lambda k: (
        ratio(session[k]["time_to_sanitized_s"], one_off[k]["time_to_sanitized_s"]) or 0.0))
    return order[len(order) // 2]


def bench(args: argparse.Namespace) -> dict:
    """Every shape and mode through one appliance; the figures as a dict."""
    global API, CLOCK_IN_SYSTEM, WINDOW_KB, WINDOW_DROPS_FIRST, SYSTEM_PROMPT, TOOLS
    API = args.api  # read by send_session, in every mode
    CLOCK_IN_SYSTEM = args.clock_in_system  # read by system_message, in every mode
    WINDOW_KB = args.window_kb  # read by request_messages, in the session modes
    WINDOW_DROPS_FIRST = args.window_drops_first
    server = args.pg
    broker = args.redis
    require_services(server, broker)
    recorded = None
    if args.corpus == "tau-bench":
        # The recorded agent's own system prompt, tools and answers, in every mode.
        recorded = recorded_sessions(args.recorded_sessions)
        SYSTEM_PROMPT, TOOLS = recorded.system, recorded.tools
        RECORDED.update(recorded.answers)
        if API == "responses":
            RECORDED_ITEMS.update(recorded_items_answers(recorded))
        args.shapes = [max(len(t) for t in recorded.sessions)]
        args.paced_shape *= args.shapes[0]
        args.backlog_shape *= args.shapes[0]
    modes = ["one-off", "session"] + (["inferred"] if args.inferred else [])
    agents = ["bench-warmup"] + [agent_name(n, m, rep=k) for n in args.shapes
                                 for m in modes for k in range(args.repeat)]
    if args.paced_shape:
        agents.append(agent_name(args.paced_shape, "session", paced=True))
    if args.backlog_shape:
        agents += [agent_name(args.backlog_shape, m, backlog=True) for m in BACKLOG_MODES]
    started = time.time()
    with appliance(server, broker, agents, keep_db=args.keep) as app:
        from governance.sanitizer import load_nlp

        # The model loads (tens of seconds on a busy 2-core machine) while the worker starts.
        loaded: dict[str, Any] = {}
        loader = threading.Thread(target=lambda: loaded.update(nlp=load_nlp(True)))
        loader.start()
        warm = ([recorded.sessions[-1][:2]] if recorded
                else [script(1, 2, 1024, args.corpus)])
        t0 = time.monotonic()
        run(app, "bench-warmup", warm, "session", None, args.drain_timeout,
            fresh_worker=False, stream=args.stream)
        app.warmup_s = round(time.monotonic() - t0, 1)
        loader.join()
        nlp = loaded["nlp"]  # as the sanitizer loads it (governance.sanitizer.core)
        shapes: list[dict] = []
        for n in args.shapes:
            if recorded:
                # Every recorded session, `--sessions` agents at once.
                scripts = recorded.sessions
                kb = (sum(message_bytes(turn) for t in scripts for turn in t)
                      / sum(len(t) for t in scripts) / 1024)
                agents: int | None = args.sessions
            else:
                kb = new_kb_for(args, n)
                scripts = [script(1000 * n + i, n, int(kb * 1024), args.corpus)
                           for i in range(args.sessions)]
                agents = None
            # Repeated (--repeat), each repetition's modes back to back, in turn first: a
            # 3-second run on two shared cores moves by a third from one run to the next.
            repeats: dict[str, list[dict]] = {m: [] for m in modes}
            for k in range(args.repeat):
                for m in (modes if k % 2 == 0 else modes[::-1]):
                    repeats[m].append(run(app, agent_name(n, m, rep=k), scripts, m, None,
                                          args.drain_timeout, stream=args.stream,
                                          agents=agents))
            shown = median_repetition(repeats)
            runs = {m: repeats[m][shown] for m in modes}
            for m in modes:
                runs[m]["agent_alone_s"] = agent_alone(app, scripts, m, args.stream, agents)
            entry = {"calls_per_session": n, "sessions": args.sessions,
                     "repetitions": args.repeat, "shown_repetition": shown + 1,
                     "time_ratios": {m: [ratio(repeats[m][k]["time_to_sanitized_s"],
                                               repeats["one-off"][k]["time_to_sanitized_s"])
                                         for k in range(args.repeat)]
                                     for m in modes if m != "one-off"},
                     "repeated_runs": {m: [{key: r[key] for key in (
                         "time_to_sanitized_s", "sent_s", "db_growth_bytes", "lag_p95_s",
                         "cpu_s")} for r in repeats[m]] for m in modes},
                     "new_kb_per_call": round(kb, 2),
                     "context_kb_last_call": round(max(message_bytes(
                         request_messages(t, len(t) - 1, "session") + TOOLS)
                         for t in scripts) / 1024, 1),
                     "ner_floor_calls_per_s": round(ner_floor(nlp, scripts), 2), "runs": runs}
            if recorded:
                lengths = [len(t) for t in scripts]
                entry["recorded"] = {
                    "source": recorded.source, "sessions": len(scripts),
                    "left_out": recorded.left_out, "calls": sum(lengths),
                    "calls_min": min(lengths), "calls_max": max(lengths),
                    "calls_mean": round(statistics.mean(lengths), 1)}
            if n == args.paced_shape:
                sustained = runs["session"]["calls_per_s"] or 0.1
                entry["paced"] = run(app, agent_name(n, "session", True), scripts, "session",
                                     args.paced_fraction * sustained, args.drain_timeout,
                                     stream=args.stream, agents=agents)
            if n == args.backlog_shape:
                entry["backlog"] = {m: run(app, agent_name(n, m, backlog=True), scripts, m,
                                           None, args.drain_timeout, stream=args.stream,
                                           backlog=True, agents=agents)
                                    for m in BACKLOG_MODES}
            shapes.append(entry)
            print(shape_table(entry), flush=True)
        failed = list(app.failed)
        warmup_s = app.warmup_s
        restarts = app.worker_restarts_s
    return {"corpus": args.corpus, "stream": args.stream,
            "clock_in_system": args.clock_in_system, "window_kb": args.window_kb,
            "api": args.api,
            "window_drops_first": args.window_drops_first,
            "shapes": shapes, "failed": failed,
            "warmup_s": warmup_s,
            "worker_restart_s": (round(statistics.mean(restarts), 1) if restarts else None),
            "wall_s": round(time.time() - started, 1), "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def beyond_agent(r: dict) -> float | None:
    """Time to sanitized less what the agent alone spends sending the same calls."""
    alone = r.get("agent_alone_s")
    return None if alone is None else round(max(r["time_to_sanitized_s"] - alone, 0.0), 2)


def appliance_cpu(r: dict) -> float | None:
    """CPU seconds the appliance's own processes used in the run (not the agent's client)."""
    cpu = r.get("cpu_s")
    return round(sum(cpu[k] for k in ("proxy", "shipper", "worker")), 2) if cpu else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def targets(entry: dict) -> list[tuple[str, float | None, float, bool]]:
    """(what, figure, target, met) for the issue's targets that apply to this shape."""
    n, s, o = entry["calls_per_session"], entry["runs"]["session"], entry["runs"]["one-off"]
    out = []
    # The time, database and rate targets are the 60- and 200-call shapes; recorded
    # sessions are as long as they were.
    shaped = "recorded" not in entry
    if shaped and n in RATIO_TARGETS:
        limit = RATIO_TARGETS[n]
        for what, key in (("time ratio", "time_to_sanitized_s"), ("db ratio", "db_growth_bytes")):
            r = ratio(s[key], o[key])
            out.append((f"{what} at {n}", r, limit, r is not None and r <= limit))
    per = ratio(s["db_bytes_per_call"], new_content_per_call(s))
    out.append(("session db bytes / new byte", per, BYTES_PER_NEW_BYTE_TARGET,
                per is not None and per <= BYTES_PER_NEW_BYTE_TARGET))
    if shaped and n == 60:
        # The pipeline's sustained rate: with all the work waiting (a backlog run) when there
        # is one; a live run's calls / time to sanitized cannot pass the agent's own sending.
        rate = entry.get("backlog", {}).get("session", {}).get("drain_calls_per_s")
        f = ratio(entry["ner_floor_calls_per_s"], rate or s["calls_per_s"])
        out.append((f"NER floor / {'backlog drain' if rate else 'sustained'} calls/s", f,
                    FLOOR_FACTOR_TARGET, f is not None and f <= FLOOR_FACTOR_TARGET))
    if "paced" in entry:
        p95 = entry["paced"]["lag_p95_s"]
        out.append((f"paced lag p95 s ({entry['paced']['rate']:.2f} calls/s)", p95,
                    LAG_P95_TARGET_S, p95 is not None and p95 < LAG_P95_TARGET_S))
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def shape_table(entry: dict) -> str:
    runs = entry["runs"]
    modes = [m for m in MODES if m in runs]
    mb = 1024 * 1024
    rows: list[tuple[str, Callable[[dict], Any]]] = [
        ("time until every step is sanitized s", lambda r: r["time_to_sanitized_s"]),
        ("  of which sending s", lambda r: r["sent_s"]),
        ("agent alone (no proxy) sending s", lambda r: r.get("agent_alone_s")),
        ("time to sanitized beyond the agent s", lambda r: beyond_agent(r)),
        ("database growth MB", lambda r: r["db_growth_bytes"] / mb),
        ("ATDP documents MB", lambda r: r["atdp_bytes"] / mb),
        ("ATDP documents, compact form MB", lambda r: r["atdp_compact_bytes"] / mb),
        ("database KB per call", lambda r: r["db_bytes_per_call"] / 1024),
        ("shared detection cache on disk MB", lambda r: r.get("detection_cache_bytes", 0) / mb),
        ("new content KB per call", lambda r: r["new_bytes_per_call"] / 1024),
        ("  plus openings KB per call", lambda r: r["opening_bytes_per_call"] / 1024),
        # The target's figure: the system prompt and tools are new at a conversation's first
        # call (decision 63); beside it the same bytes against the new messages alone.
        ("database bytes / new byte", lambda r: ratio(r["db_bytes_per_call"],
                                                      new_content_per_call(r))),
        ("  against new messages only", lambda r: ratio(
            r["db_bytes_per_call"], r["new_bytes_per_call"])),
        ("sustained calls/s", lambda r: r["calls_per_s"]),
        ("step lag p50 s", lambda r: r["lag_p50_s"]),
        ("step lag p95 s", lambda r: r["lag_p95_s"]),
        ("open the last call's raw payload ms", lambda r: r.get("raw_open_last_ms")),
        ("raw payloads sealed whole", lambda r: r.get("raw_whole_copies")),
        ("CPU s: appliance (all but the agent)", lambda r: appliance_cpu(r)),
        ("CPU s: worker (all processes)", lambda r: r.get("cpu_s", {}).get("worker")),
        ("CPU s: proxy", lambda r: r.get("cpu_s", {}).get("proxy")),
        ("CPU s: shipper", lambda r: r.get("cpu_s", {}).get("shipper")),
        ("CPU s: agent client + upstream (bench)", lambda r: r.get("cpu_s", {}).get("bench")),
        ("trajectories", lambda r: r["trajectories"]),
        ("steps", lambda r: r["steps"]),
    ]
    head = (f"\n== {entry['calls_per_session']} calls x {entry['sessions']} sessions, "
            f"{entry['new_kb_per_call']} KB new content per call, "
            f"{entry['context_kb_last_call']} KB context at the last call ==")
    if "recorded" in entry:
        r = entry["recorded"]
        head = (f"\n== {r['sessions']} recorded sessions ({r['left_out']} left out) of "
                f"{r['calls_min']}-{r['calls_max']} calls (mean {r['calls_mean']}, "
                f"{r['calls']} calls), {entry['sessions']} agents at once, "
                f"{entry['new_kb_per_call']} KB new content per call (mean), "
                f"{entry['context_kb_last_call']} KB context at the longest call ==")
    cols = "".join(f"{m:>12}" for m in modes) + "".join(
        f"{m + '/1-off':>15}" for m in modes if m != "one-off")
    lines = [head, f"{'':38}{cols}"]
    for label, get in rows:
        values = {m: get(runs[m]) for m in modes}
        line = f"{label:38}" + "".join(f"{_fmt(values[m]):>12}" for m in modes)
        if not label.startswith(("trajectories", "steps", "new content", "  of which",
                                 "agent alone", "open the last", "raw payloads",
                                 "  against new messages", "  plus openings")):
            line += "".join(f"{_fmt(ratio(values[m], values['one-off'])):>15}"
                            for m in modes if m != "one-off")
        lines.append(line)
    if entry.get("repetitions", 1) > 1:
        for m, ratios in entry["time_ratios"].items():
            lines.append(f"{m + '/1-off time, each repetition':38}"
                         + ", ".join(f"{_fmt(r)}x" for r in ratios)
                         + f" (the table: repetition {entry['shown_repetition']}, the median)")
    floor = entry["ner_floor_calls_per_s"]
    lines.append(f"{'NER floor calls/s (spaCy, new text)':38}{_fmt(floor):>12}   "
                 f"floor / session sustained: "
                 f"{_fmt(ratio(floor, runs['session']['calls_per_s']))}x")
    if "paced" in entry:
        p = entry["paced"]
        lines.append(f"{'paced session run':38}{p['rate']:.2f} calls/s offered: "
                     f"lag p50 {_fmt(p['lag_p50_s'])} s, p95 {_fmt(p['lag_p95_s'])} s, "
                     f"sustained {_fmt(p['calls_per_s'])} calls/s")
    if "backlog" in entry:
        # The same calls queued with the worker stopped, then built: the pipeline's own time
        # and rate, the agent's sending out of it.
        b = entry["backlog"]
        for m in BACKLOG_MODES:
            lines.append(f"{'backlog ' + m + ' run':38}{b[m]['calls']} calls sent and shipped "
                         f"with the worker stopped, built {_fmt(b[m].get('drain_s'))} s after "
                         f"it was ready: {_fmt(b[m].get('drain_calls_per_s'))} calls/s, worker "
                         f"CPU {_fmt(b[m]['cpu_s'].get('worker'))} s")
        s_, o_ = b["session"], b["one-off"]
        lines.append(f"{'backlog session/1-off':38}drain time "
                     f"{_fmt(ratio(s_.get('drain_s'), o_.get('drain_s')))}x, worker CPU "
                     f"{_fmt(ratio(s_['cpu_s'].get('worker'), o_['cpu_s'].get('worker')))}x; "
                     f"floor / session backlog drain: "
                     f"{_fmt(ratio(floor, s_.get('drain_calls_per_s')))}x")
    for m in modes:  # where a call's bytes go (the README's per-table figures)
        lines.append(f"{m + ' KB per call by table':38}" + by_table(runs[m]))
    if "paced" in entry:
        lines.append(f"{'paced KB per call by table':38}" + by_table(entry["paced"]))
    for m in modes:  # where the worker's time goes (what explains a slow run)
        lines.append(f"{m + ' worker':38}" + worker_line(runs[m]))
    if "paced" in entry:
        lines.append(f"{'paced worker':38}" + worker_line(entry["paced"]))
    if "backlog" in entry:
        for m in BACKLOG_MODES:
            lines.append(f"{'backlog ' + m + ' worker':38}" + worker_line(entry["backlog"][m]))
    for what, value, limit, met in targets(entry):
        lines.append(f"target {what:<48} {_fmt(value):>8} <= {limit:<5} "
                     f"{'met' if met else 'MISSED'}")
    return "\n".join(lines)


def by_table(r: dict) -> str:
    """The run's growth per call by table (app prefix and partition suffix dropped), largest
    first; tables that did not grow are left out."""
    parts = []
    for table, grown in r["db_growth_top"].items():
        if grown > 0:
            name = re.sub(r"_p\d{4}_\d{2}$", "", table.removeprefix("governance_"))
            parts.append(f"{name} {grown / r['calls'] / 1024:.2f}")
    return ", ".join(parts) or "-"


def summary_table(result: dict) -> str:
    lines = ["\n== session / one-off (issue 16's table) ==",
             f"{'session length':>15} {'time to sanitized':>26} {'database growth':>28} "
             f"{'ATDP':>7} {'compact':>8} {'db/new byte':>12}"]
    for e in result["shapes"]:
        s, o = e["runs"]["session"], e["runs"]["one-off"]
        mb = 1024 * 1024
        label = (f"{e['recorded']['sessions']:>6} recorded" if "recorded" in e
                 else f"{e['calls_per_session']:>9} calls")
        lines.append(
            f"{label} "
            f"{_fmt(ratio(s['time_to_sanitized_s'], o['time_to_sanitized_s'])) + 'x':>7} "
            f"({_fmt(s['time_to_sanitized_s'])} s vs {_fmt(o['time_to_sanitized_s'])} s)"
            f"{_fmt(ratio(s['db_growth_bytes'], o['db_growth_bytes'])) + 'x':>8} "
            f"({s['db_growth_bytes'] / mb:.1f} MB vs {o['db_growth_bytes'] / mb:.1f} MB)"
            f"{_fmt(ratio(s['atdp_bytes'], o['atdp_bytes'])) + 'x':>8}"
            f"{_fmt(ratio(s['atdp_compact_bytes'], o['atdp_compact_bytes'])) + 'x':>9}"
            f"{_fmt(ratio(s['db_bytes_per_call'], new_content_per_call(s))):>12}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    server = os.environ.get("DATABASE_URL")
    broker = os.environ.get("CELERY_BROKER_URL", "")
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.split("\n")[4:]))
    ap.add_argument("--shapes", default=None,
                    help="comma-separated session lengths in calls (default 10,60,200; "
                         "--quick: 10)")
    ap.add_argument("--sessions", type=int, default=None,
                    help="sessions sent concurrently per shape and mode, each by its own "
                         "thread (default 2; --quick: 1)")
    ap.add_argument("--new-kb", type=float, default=None,
                    help="new content per call in KB: the assistant's tool call plus the tool "
                         "result (default 3; --quick: 1)")
    ap.add_argument("--context-kb", type=float, default=0,
                    help="instead of --new-kb: size each shape's new content so that its last "
                         "call carries about this many KB of context (e.g. 100 for 200 calls); "
                         "a turn (tool call + one customer record) is at least ~0.6 KB, so "
                         "200 calls reach ~130 KB at the least (the table prints the context "
                         "reached)")
    ap.add_argument("--corpus", choices=CORPORA, default="generated",
                    help="what the tool results (and the first user message) hold: "
                         "'generated', customer records planted by tests/bench/corpus.py "
                         "(default), or 'presidio-research', that project's synthetic PII "
                         "sentences (tests/bench/data, written by nobody here) as support "
                         "notes; or 'tau-bench': instead of generated sessions, the 200 "
                         "GPT-4o airline sessions recorded by tau-bench (its system prompt, "
                         "14 tools, customer and tool messages and the model's answers, "
                         "2-30 calls each; --shapes and --new-kb do not apply, --sessions "
                         "is how many agents send them at once)")
    ap.add_argument("--recorded-sessions", type=int, default=0, metavar="N",
                    help="with --corpus tau-bench: only the first N recorded sessions "
                         "(default: all)")
    ap.add_argument("--stream", action="store_true",
                    help="every call streamed (server-sent events, usage included), in every "
                         "mode: the proxy passes the stream through as it comes and the "
                         "worker rebuilds the answer from its chunks")
    ap.add_argument("--inferred", action="store_true",
                    help="also run each session without X-Steward-Session (the proxy infers "
                         "the trajectory from the conversation prefix)")
    ap.add_argument("--clock-in-system", action="store_true",
                    help="the system prompt ends with the date and time of the call and its "
                         "turn, so it changes with every call (in every mode), as with agents "
                         "that put the date or a memory block there")
    ap.add_argument("--window-kb", type=float, default=0,
                    help="a session's requests carry at most this many KB of messages: the "
                         "oldest turns after the first user message are dropped, as agents "
                         "that keep their context under a budget do (every call past the "
                         "window is a truncated history; default 0: the whole history)")
    ap.add_argument("--window-drops-first", action="store_true",
                    help="with --window-kb: a pure sliding window, the first user message is "
                         "dropped too once the window is full (no stored state is then a "
                         "prefix of a later call: what --inferred must recognise)")
    ap.add_argument("--paced-shape", type=int, default=None,
                    help="run this shape's sessions once more, paced below the sustained rate "
                         "just measured, for the lag p95 at that rate (default 60 when 60 is "
                         "among the shapes and not --quick; 0: never; with --corpus tau-bench "
                         "any positive value: the recorded sessions, default never)")
    ap.add_argument("--backlog-shape", type=int, default=None,
                    help="run this shape's sessions once more with the worker stopped until "
                         "every call is shipped, for the rate the pipeline sustains with all "
                         "the work waiting (default 60 when 60 is among the shapes and not "
                         "--quick; 0: never; with --corpus tau-bench any positive value: the "
                         "recorded sessions, default never)")
    ap.add_argument("--paced-fraction", type=float, default=0.8,
                    help="the paced run's rate as a fraction of the session run's sustained "
                         "calls/s (default 0.8)")
    ap.add_argument("--drain-timeout", type=float, default=3600,
                    help="seconds to wait for a run's steps after its last call (default 3600)")
    ap.add_argument("--quick", action="store_true",
                    help="a fast run: shape 10, one session, 1 KB per call, no paced run "
                         "(options given explicitly still win)")
    ap.add_argument("--pg", default=with_db(server, "postgres") if server else DEFAULT_SERVER,
                    help="PostgreSQL maintenance database URL where the throwaway database is "
                         "created (default: DATABASE_URL's server, else " + DEFAULT_SERVER + ")")
    ap.add_argument("--redis", default=broker if broker.startswith(("redis://", "rediss://"))
                    else DEFAULT_REDIS,
                    help="Redis broker URL (default: CELERY_BROKER_URL when it is redis://, "
                         "else " + DEFAULT_REDIS + "); the run's keys carry their own prefix")
    ap.add_argument("--keep", action="store_true",
                    help="keep the throwaway database (its name and the run's throwaway "
                         "master key are printed, to open its payloads) and the logs of the "
                         "proxy, shipper and worker")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each shape's modes this many times (each repetition's modes back "
                         "to back, in turn first, a fresh worker before each run) and show the "
                         "repetition whose session/one-off time ratio is the median; every "
                         "repetition's ratio is printed (default 1)")
    ap.add_argument("--api", choices=("chat", "responses"), default="chat",
                    help="the API the agent calls: 'chat' (chat completions, default) or "
                         "'responses', the same conversations as a stateless Responses API "
                         "agent sends them (the OpenAI Agents SDK, `store: false`): the whole "
                         "input every call, the model's output items echoed back, the system "
                         "prompt as `instructions`, no previous_response_id (not with --stream)")
    ap.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    ap.add_argument("--strict", action="store_true",
                    help="exit 2 when an issue-16 target is missed")
    args = ap.parse_args(argv)
    if args.corpus == "tau-bench":
        given = [o for o, v in (("--shapes", args.shapes), ("--new-kb", args.new_kb),
                                ("--context-kb", args.context_kb)) if v]
        if given:
            ap.error(f"--corpus tau-bench replays recorded sessions as they were: "
                     f"{', '.join(given)} does not apply")
        args.shapes = "30"  # replaced by the longest recorded session's length
    elif args.recorded_sessions:
        ap.error("--recorded-sessions needs --corpus tau-bench")
    if args.recorded_sessions < 0:
        ap.error("--recorded-sessions: a positive count")
    shapes = args.shapes or ("10" if args.quick else "10,60,200")
    args.shapes = [int(s) for s in shapes.split(",") if s.strip()]
    if not args.shapes or min(args.shapes) < 2:
        ap.error("--shapes: session lengths of at least 2 calls")
    if args.repeat < 1:
        ap.error("--repeat: at least 1")
    if args.api == "responses" and args.stream:
        ap.error("--api responses: streamed calls are not built for it (drop --stream)")
    if args.window_drops_first and not args.window_kb:
        ap.error("--window-drops-first needs --window-kb")
    args.sessions = args.sessions or (1 if args.quick else 2)
    args.new_kb = args.new_kb or (1.0 if args.quick else 3.0)
    if args.corpus == "tau-bench":
        # Any positive value: the recorded sessions (bench() sets their shape); none by default.
        args.paced_shape, args.backlog_shape = int(bool(args.paced_shape)), int(bool(
            args.backlog_shape))
    if args.paced_shape is None:
        args.paced_shape = 60 if 60 in args.shapes and not args.quick else 0
    elif args.paced_shape and args.paced_shape not in args.shapes and args.corpus != "tau-bench":
        ap.error("--paced-shape must be one of --shapes")
    if args.backlog_shape is None:
        args.backlog_shape = 60 if 60 in args.shapes and not args.quick else 0
    elif (args.backlog_shape and args.backlog_shape not in args.shapes
          and args.corpus != "tau-bench"):
        ap.error("--backlog-shape must be one of --shapes")
    return args


def window_note(window_kb: float, drops_first: bool = False) -> str:
    if not window_kb:
        return ""
    return f", a {window_kb:g} KB {'sliding ' if drops_first else ''}window"


def _unwind_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM (a test's timeout stopping this run's process group) unwinds as Ctrl-C does,
    # so `appliance` stops its processes and drops its database instead of leaving them.
    signal.signal(signal.SIGTERM, _unwind_on_sigterm)
    result = bench(args)
    print(summary_table(result))
    print(f"\nwall {result['wall_s']} s, warm-up {result['warmup_s']} s, worker restart "
          f"{result['worker_restart_s']} s (mean, before each run), {result['cpus']} CPUs, "
          f"load average {result['load_avg_1m']}, corpus {result['corpus']}"
          f"{', streamed' if result['stream'] else ''}"
          f"{', the Responses API' if result.get('api') == 'responses' else ''}"
          f"{', the clock in the system prompt' if result['clock_in_system'] else ''}"
          f"{window_note(result['window_kb'], result.get('window_drops_first', False))}")
    for line in result["failed"]:
        print(f"FAILED: {line}")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if result["failed"]:
        return 1
    missed = [t for e in result["shapes"] for t in targets(e) if not t[3]]
    return 2 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
