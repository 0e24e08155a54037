"""Seeded generator of agent-traffic bodies with planted identifiers, secrets and benign
look-alikes (the sanitizer evaluation corpus; the generator is committed, never its output).

Each case is {"kind": "request" | "response", "endpoint": ..., "body": {...},
"planted": [(entity_type, value), ...], "benign": [token, ...]}. Values are planted in user
text, system prompts, tool-call arguments, tool results (JSON and text), multi-part content,
Responses-API items and response bodies (chat, completions, responses).

    python -m tests.bench.corpus --n 5 --seed 1   # print a few cases as JSONL
"""

from __future__ import annotations

import base64
import json
import random
import string
import sys
from dataclasses import dataclass, field
from typing import Any

from faker import Faker

NAME_LOCALES = ["en_US", "en_GB", "de_DE", "fr_FR", "es_ES", "it_IT", "nl_NL", "en_IN",
                "pt_BR", "en_AU"]
PHONE_LOCALES = ["en_US", "en_GB", "de_DE", "fr_FR", "en_IN", "pt_BR", "en_AU", "ja_JP",
                 "es_ES", "it_IT", "nl_NL"]
IBAN_LOCALES = ["en_GB", "de_DE", "fr_FR", "es_ES", "nl_NL", "it_IT"]

ENTITIES = ["PERSON", "EMAIL_ADDRESS", "PHONE_NUMBER", "IBAN_CODE", "CREDIT_CARD",
            "IP_ADDRESS", "US_SSN", "UK_NINO", "UK_NHS", "IN_PAN", "IN_AADHAAR",
            "OPENAI_API_KEY", "AWS_ACCESS_KEY", "AWS_SECRET_KEY", "GITHUB_TOKEN", "SLACK_TOKEN",
            "STRIPE_KEY", "GOOGLE_API_KEY", "BEARER_TOKEN", "JWT", "PRIVATE_KEY",
            "URL_PASSWORD"]


@dataclass
class Case:
    kind: str
    endpoint: str
    body: dict[str, Any]
    planted: list[tuple[str, str]] = field(default_factory=list)
    benign: list[str] = field(default_factory=list)


class Gen:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.fakers = {loc: Faker(loc) for loc in sorted(set(NAME_LOCALES + PHONE_LOCALES
                                                             + IBAN_LOCALES))}
        for i, f in enumerate(self.fakers.values()):
            f.seed_instance(seed * 1000 + i)
        self.en = self.fakers["en_US"]

    # -- planted values

    def _rand(self, alphabet: str, n: int) -> str:
        return "".join(self.rng.choice(alphabet) for _ in range(n))

    def person(self) -> str:
        f = self.fakers[self.rng.choice(NAME_LOCALES)]
        return f"{f.first_name()} {f.last_name()}"

    def value(self, entity: str, name: str | None = None) -> str:
        r, an = self.rng, string.ascii_letters + string.digits
        if entity == "PERSON":
            return name or self.person()
        if entity == "EMAIL_ADDRESS":
            if name and r.random() < 0.5:
                first, last = name.lower().split()[0], name.lower().split()[-1]
                local = "".join(c for c in f"{first}.{last}" if c.isalnum() or c == ".")
                return f"{local}@{self.en.free_email_domain()}"
            return self.en.email()
        if entity == "PHONE_NUMBER":
            return self.fakers[r.choice(PHONE_LOCALES)].phone_number()
        if entity == "IBAN_CODE":
            iban = self.fakers[r.choice(IBAN_LOCALES)].iban()
            if r.random() < 0.4:
                iban = " ".join(iban[i:i + 4] for i in range(0, len(iban), 4))
            return iban
        if entity == "CREDIT_CARD":
            cc = self.en.credit_card_number(card_type=r.choice(
                ["visa16", "mastercard", "amex", "discover", "visa13"]))
            if r.random() < 0.4 and len(cc) == 16:
                cc = r.choice([" ", "-"]).join(cc[i:i + 4] for i in range(0, 16, 4))
            return cc
        if entity == "IP_ADDRESS":
            return self.en.ipv4_public() if r.random() < 0.7 else self.en.ipv6()
        if entity == "US_SSN":
            return self.fakers["en_US"].ssn()
        if entity == "UK_NINO":
            first = r.choice("ABCEGHJKLMNOPRSTWXYZ")
            second = r.choice("ABCEGHJKLMNPRSTWXYZ")
            while first + second in {"BG", "GB", "NK", "KN", "TN", "NT", "ZZ"}:
                second = r.choice("ABCEGHJKLMNPRSTWXYZ")
            d = self._rand(string.digits, 6)
            nino = f"{first}{second}{d}{r.choice('ABCD')}"
            return nino if r.random() < 0.5 else f"{nino[:2]} {d[:2]} {d[2:4]} {d[4:]} {nino[-1]}"
        if entity == "UK_NHS":
            while True:
                d = [r.randrange(10) for _ in range(9)]
                check = 11 - sum(x * w for x, w in zip(d, range(10, 1, -1), strict=True)) % 11
                check = 0 if check == 11 else check
                if check != 10:
                    s = "".join(map(str, d)) + str(check)
                    return f"{s[:3]} {s[3:6]} {s[6:]}"
        if entity == "IN_PAN":
            return (self._rand(string.ascii_uppercase, 3) + r.choice("PCHFT")
                    + self._rand(string.ascii_uppercase, 1) + self._rand(string.digits, 4)
                    + self._rand(string.ascii_uppercase, 1))
        if entity == "IN_AADHAAR":
            from governance.recognizers import verhoeff_ok

            while True:
                s = str(r.randint(2, 9)) + self._rand(string.digits, 11)
                if verhoeff_ok(s):
                    return f"{s[:4]} {s[4:8]} {s[8:]}"
        if entity == "OPENAI_API_KEY":
            return r.choice(["sk-proj-", "sk-"]) + self._rand(an + "_-", 48)
        if entity == "AWS_ACCESS_KEY":
            return "AKIA" + self._rand(string.ascii_uppercase + "234567", 16)
        if entity == "AWS_SECRET_KEY":
            return self._rand(an + "/+", 40)
        if entity == "GITHUB_TOKEN":
            return (r.choice(["ghp_", "gho_", "ghs_"]) + self._rand(an, 36) if r.random() < 0.7
                    else "github_pat_" + self._rand(an + "_", 82))
        if entity == "SLACK_TOKEN":
            return (f"xox{r.choice('bpa')}-{self._rand(string.digits, 12)}-"
                    f"{self._rand(string.digits, 12)}-{self._rand(an, 24)}")
        if entity == "STRIPE_KEY":
            return r.choice(["sk_live_", "rk_live_"]) + self._rand(an, 24)
        if entity == "GOOGLE_API_KEY":
            return "AIza" + self._rand(an + "_-", 35)
        if entity == "BEARER_TOKEN":
            return self._rand(an + "._-", 40)
        if entity == "JWT":
            def b64(obj: dict) -> str:
                return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")
            return (b64({"alg": "HS256", "typ": "JWT"}) + "."
                    + b64({"sub": self._rand(string.digits, 8), "name": self.person(),
                           "iat": r.randint(1_600_000_000, 1_800_000_000)}) + "."
                    + self._rand(an + "_-", 43))
        if entity == "PRIVATE_KEY":
            body = "\n".join(self._rand(an + "+/", 64) for _ in range(r.randint(3, 8)))
            kind = r.choice(["RSA ", "EC ", "OPENSSH ", ""])
            return (f"-----BEGIN {kind}PRIVATE KEY-----\n{body}\n"
                    f"-----END {kind}PRIVATE KEY-----")
        if entity == "URL_PASSWORD":
            return self._rand(an + "!*", r.randint(10, 20))
        raise ValueError(entity)

    # -- how each value appears in text

    def sentence(self, entity: str, value: str) -> str:
        r = self.rng
        if entity == "PERSON":
            return r.choice([
                f"Hi, my name is {value} and I need help with my account.",
                f"Please update the shipping address for {value}.",
                f"{value} called yesterday about the delayed delivery.",
                f"Can you check whether {value} has an open refund?",
                f"Dear {value}, thank you for contacting support.",
                f"The ticket was reported by {value} this morning.",
                f"I spoke with {value} and they confirmed the change.",
                f"Forward this to {value} when you are done.",
                f"Customer {value} wants to cancel the subscription.",
                f"Thanks,\n{value}",
            ])
        if entity == "BEARER_TOKEN":
            return r.choice([f"Use the header Authorization: Bearer {value} for the call.",
                             f"curl -H 'Authorization: Bearer {value}' https://api.internal/x"])
        if entity == "AWS_SECRET_KEY":
            return r.choice([f"aws_secret_access_key = {value}",
                             f"The AWS secret is {value}, rotate it after the test.",
                             f"export AWS_SECRET_ACCESS_KEY={value}"])
        if entity == "URL_PASSWORD":
            host = self.en.domain_word()
            return r.choice([
                f"Connect with postgres://app:{value}@{host}.internal:5432/orders to debug.",
                f"The broker URL is amqp://svc:{value}@{host}:5672// for now.",
                f"Clone from https://deploy:{value}@git.{host}.com/repo.git please."])
        if entity == "PRIVATE_KEY":
            return f"Here is the deploy key:\n{value}\nDo not share it."
        label = {"EMAIL_ADDRESS": "email", "PHONE_NUMBER": "phone number", "IBAN_CODE": "IBAN",
                 "CREDIT_CARD": "card number", "IP_ADDRESS": "IP address", "US_SSN": "SSN",
                 "UK_NINO": "national insurance number", "UK_NHS": "NHS number",
                 "IN_PAN": "PAN", "IN_AADHAAR": "Aadhaar number"}.get(entity, "key")
        return r.choice([
            f"My {label} is {value}.",
            f"Please use {value} for this.",
            f"Update the record: {label} {value}, thanks!",
            f"They sent {value} in the form yesterday",
            f"({value})",
            f"{label}: {value}",
            f"Could you verify {value} against the {label} on file?",
        ])

    def benign(self) -> str:
        r = self.rng
        return r.choice([
            lambda: f"ORD-{r.randint(1000, 99999999)}",
            lambda: f"SKU-{self._rand(string.ascii_uppercase, 2)}-{r.randint(100, 99999)}",
            lambda: f"v{r.randint(0, 12)}.{r.randint(0, 30)}.{r.randint(0, 99)}",
            lambda: f"{r.randint(0, 9)}.{r.randint(0, 30)}.{r.randint(0, 99)}",
            lambda: f"{r.choice(['JIRA', 'PROJ', 'OPS', 'BUG'])}-{r.randint(1, 99999)}",
            lambda: f"INC{r.randint(0, 9999999):07d}",
            lambda: self._rand("0123456789abcdef", r.choice([7, 8, 12, 40])),
            lambda: self.en.iso8601() + "Z",
            lambda: self.en.date_time().strftime("%Y-%m-%d %H:%M:%S"),
            lambda: str(r.randint(1_500_000_000, 1_800_000_000)),
            lambda: f"${r.randint(1, 99999):,}.{r.randint(0, 99):02d}",
            lambda: f"€{r.randint(1, 999)}.{r.randint(0, 99):02d}",
            lambda: f"{r.randint(1, 500)} units",
            lambda: f"TRK{r.randint(10**9, 10**10)}",
            lambda: "IBAN",
            lambda: str(self.en.uuid4()),
        ])()

    def benign_sentence(self, token: str) -> str:
        return self.rng.choice([
            f"Order reference {token} is still pending.",
            f"See {token} for details.",
            f"The build {token} fixed the regression.",
            f"Last updated {token} by the sync job.",
            f"Total {token} incl. VAT.",
            f"Linked item: {token}",
        ])


def _chat_request(g: Gen, parts: dict[str, list[str]], tool_args: dict, tool_result: Any,
                  multipart: bool) -> dict:
    r = g.rng
    user_text = " ".join(parts["user"]) or "Where is my order?"
    user_content: Any = user_text
    if multipart:
        user_content = [{"type": "text", "text": user_text},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                            + g._rand(string.ascii_letters, 64),
                                                            "detail": "low"}}]
    call_id = "call_" + g._rand(string.ascii_letters + string.digits, 24)
    messages: list[dict] = [
        {"role": "system", "content": "You are a careful support agent for Acme Bank. "
         + " ".join(parts["system"])},
        {"role": "user", "content": user_content},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": r.choice(["lookup_customer", "create_refund", "send_email"]),
                          "arguments": json.dumps(tool_args)}}]},
        {"role": "tool", "tool_call_id": call_id,
         "content": json.dumps(tool_result) if not isinstance(tool_result, str) else tool_result},
    ]
    if parts["followup"]:
        messages.append({"role": "user", "content": " ".join(parts["followup"])})
    return {"model": r.choice(["gpt-4o-mini", "qwen2.5-7b-instruct", "llama-3.1-8b"]),
            "messages": messages, "temperature": 0.2, "stream": False,
            "tools": [{"type": "function", "function": {
                "name": "lookup_customer", "description": "Look up a customer record.",
                "parameters": {"type": "object", "properties": {
                    "customer_name": {"type": "string"}, "email": {"type": "string"}},
                    "required": ["customer_name"]}}}]}


def _responses_request(g: Gen, parts, tool_args, tool_result) -> dict:
    call_id = "call_" + g._rand(string.ascii_letters + string.digits, 24)
    return {"model": "gpt-4.1-mini", "instructions": "You are an operations agent. "
            + " ".join(parts["system"]),
            "input": [
                {"role": "user", "content": [{"type": "input_text",
                                              "text": " ".join(parts["user"]) or "Hello"}]},
                {"type": "function_call", "call_id": call_id, "name": "lookup_customer",
                 "arguments": json.dumps(tool_args)},
                {"type": "function_call_output", "call_id": call_id,
                 "output": json.dumps(tool_result) if not isinstance(tool_result, str)
                 else tool_result},
                {"role": "user", "content": " ".join(parts["followup"]) or "Thanks."},
            ],
            "previous_response_id": "resp_" + g._rand(string.hexdigits.lower(), 32),
            "metadata": {"ticket": "JIRA-" + str(g.rng.randint(1, 9999))}}


def _chat_response(g: Gen, text: str) -> dict:
    return {"id": "chatcmpl-" + g._rand(string.ascii_letters + string.digits, 29),
            "object": "chat.completion", "created": g.rng.randint(1_700_000_000, 1_800_000_000),
            "model": "qwen2.5-7b-instruct",
            "system_fingerprint": "fp_" + g._rand("0123456789abcdef", 10),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 120, "completion_tokens": 48, "total_tokens": 168}}


def _responses_response(g: Gen, text: str, tool_args: dict) -> dict:
    return {"id": "resp_" + g._rand("0123456789abcdef", 32), "object": "response",
            "created_at": g.rng.randint(1_700_000_000, 1_800_000_000), "status": "completed",
            "model": "gpt-4.1-mini-2025-04-14",
            "output": [
                {"id": "rs_" + g._rand("0123456789abcdef", 16), "type": "reasoning",
                 "summary": [{"type": "summary_text", "text": "Checking the account."}]},
                {"id": "msg_" + g._rand("0123456789abcdef", 16), "type": "message",
                 "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": text, "annotations": []}]},
                {"id": "fc_" + g._rand("0123456789abcdef", 16), "type": "function_call",
                 "status": "completed", "call_id": "call_" + g._rand("abcdef0123456789", 20),
                 "name": "create_refund", "arguments": json.dumps(tool_args)}],
            "usage": {"input_tokens": 200, "output_tokens": 60, "total_tokens": 260}}


def _completion_response(g: Gen, text: str) -> dict:
    return {"id": "cmpl-" + g._rand(string.ascii_letters, 24), "object": "text_completion",
            "created": g.rng.randint(1_700_000_000, 1_800_000_000), "model": "llama-3.1-8b",
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": "length"}]}


def generate(n: int = 300, seed: int = 7) -> list[Case]:
    g = Gen(seed)
    r = g.rng
    cases: list[Case] = []
    for _ in range(n):
        planted: list[tuple[str, str]] = []
        benign: list[str] = []
        parts: dict[str, list[str]] = {"user": [], "system": [], "followup": [], "response": []}
        name = g.person()
        entities = r.sample(ENTITIES, k=r.randint(3, 6))
        if "PERSON" not in entities and r.random() < 0.6:
            entities.append("PERSON")
        tool_args: dict[str, Any] = {"order_id": f"ORD-{r.randint(1000, 999999)}",
                                     "limit": r.randint(1, 50)}
        tool_result: Any = {"status": "ok", "items": r.randint(0, 9)}
        for ent in entities:
            value = g.value(ent, name)
            planted.append((ent, value))
            where = r.choice(["user", "system", "followup", "response", "tool_args",
                              "tool_result", "tool_result_text"])
            if where == "tool_args":
                key = {"PERSON": "customer_name", "EMAIL_ADDRESS": "email",
                       "PHONE_NUMBER": "phone", "IBAN_CODE": "iban",
                       "CREDIT_CARD": "card_number", "IP_ADDRESS": "client_ip"}.get(ent)
                if key and r.random() < 0.6:
                    tool_args[key] = value
                else:
                    tool_args.setdefault("note", "")
                    tool_args["note"] += g.sentence(ent, value) + " "
            elif where == "tool_result" and isinstance(tool_result, dict) and ent != "PRIVATE_KEY":
                key = {"PERSON": "owner", "EMAIL_ADDRESS": "contact_email",
                       "PHONE_NUMBER": "contact_phone"}.get(ent)
                if key and r.random() < 0.6:
                    tool_result[key] = value
                else:
                    tool_result.setdefault("log", []).append(g.sentence(ent, value))
            elif where == "tool_result_text":
                prefix = tool_result if isinstance(tool_result, str) else "Lookup result:"
                tool_result = f"{prefix} {g.sentence(ent, value)}"
            else:
                parts[where if where in parts else "user"].append(g.sentence(ent, value))
        for _ in range(r.randint(2, 4)):
            token = g.benign()
            benign.append(token)
            parts[r.choice(["user", "system", "followup", "response"])].append(
                g.benign_sentence(token))
        # Some plain chatter so NER sees realistic text length.
        parts["user"].append(g.en.sentence(nb_words=r.randint(6, 14)))
        resp_text = " ".join(parts["response"]) or "I have updated the order."
        shape = r.random()
        if shape < 0.45:
            cases.append(Case("request", "chat.completions", _chat_request(
                g, parts, tool_args, tool_result, multipart=r.random() < 0.3), planted, benign))
            cases.append(Case("response", "chat.completions", _chat_response(g, resp_text),
                              [], []))
        elif shape < 0.8:
            cases.append(Case("request", "responses",
                              _responses_request(g, parts, tool_args, tool_result),
                              planted, benign))
            cases.append(Case("response", "responses",
                              _responses_response(g, resp_text, tool_args), [], []))
        else:
            prompt = "\n".join(parts["system"] + parts["user"] + parts["followup"]
                               + [json.dumps(tool_args), json.dumps(tool_result)])
            cases.append(Case("request", "completions",
                              {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 64},
                              planted, benign))
            cases.append(Case("response", "completions", _completion_response(g, resp_text),
                              [], []))
        # Planted values of the pair are attributed to the request (the response repeats some);
        # the checker looks at both bodies of a pair.
        cases[-1].planted = []
    return cases


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    for case in generate(args.n, args.seed):
        sys.stdout.write(json.dumps(case.body) + "\n")


if __name__ == "__main__":
    main()
