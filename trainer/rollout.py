"""Rollout backends: prompt token ids in; completion ids, behaviour log-probs, finish reason and
weight version out. One interface, two engines:

- HFRollout: a sampling loop over a transformers causal LM with a KV cache (CPU or GPU). It
  reads the policy's weights in place, so a weight sync is only a version bump.
- SGLangRollout: an SGLang server over HTTP (native `/generate` with `input_ids` and
  `return_logprob`); new weights are pushed with `/update_weights_from_disk` between
  `/pause_generation` and `/continue_generation`.

Order contract: generate(prompts, n) returns len(prompts) * n rollouts, prompt-major, so rows
[i*n, (i+1)*n) are prompt i's group — the layout grpo.group_advantages expects.
"""

from __future__ import annotations

import inspect
import json
import logging
import urllib.error
import urllib.request
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

log = logging.getLogger(__name__)


def _sglang_message(body: bytes) -> str:
    """': <message>' when `body` is SGLang's JSON error ({"message": "..."}), else ''."""
    try:
        message = json.loads(body).get("message")
    except (ValueError, AttributeError):
        return ""
    return f": {message[:200]}" if isinstance(message, str) and message else ""


def _phrase(code: int) -> str:
    """The standard reason phrase (never the server's own status line text)."""
    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return ""


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]          # sampled tokens, the stop token included when it came
    behaviour_logprobs: list[float]    # log p of each completion token under the sampler
    finish_reason: str                 # "stop" | "length" | "abort"
    weight_version: str | None         # which policy weights produced it
    # 1 where the policy sampled the token, 0 where the environment inserted it (tool results,
    # user turns in a multi-turn completion). None: every completion token was sampled.
    completion_mask: list[int] | None = None

    def loss_mask(self) -> list[int]:
        return self.completion_mask if self.completion_mask is not None \
            else [1] * len(self.completion_ids)


@runtime_checkable
class RolloutBackend(Protocol):
    def generate(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                 temperature: float, seed: int | None) -> list[Rollout]: ...

    def sync_weights(self, policy: torch.nn.Module, weight_version: str) -> None:
        """Make the next generate() sample from `policy`'s current weights."""
        ...


class RolloutError(RuntimeError):
    pass


class EngineUnreachable(RolloutError):
    """No answer from the engine at all (connection refused, DNS, timeout): worth a bounded
    retry, unlike an engine that answered and refused."""


# ------------------------------------------------------------------------------ transformers

class HFRollout:
    """Batched ancestral sampling with a KV cache over a transformers causal LM.

    Prompts are left-padded (position ids from the attention mask, so a padded prompt sees the
    same positions as an unpadded one); at every step the next token is drawn from
    softmax(logits / temperature) with a seeded torch.Generator, and its log-prob under that
    same distribution is the behaviour log-prob — what the trainer recomputes with
    token_logprobs(logits / temperature). A hand loop instead of `model.generate` because it
    returns exactly these log-probs and skips generate's per-call set-up, which dominates on
    a small model."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int | list[int], pad_token_id: int,
                 weight_version: str = "0") -> None:
        self.model = model
        self.eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.pad_token_id = pad_token_id
        self.weight_version = weight_version

    def sync_weights(self, policy: torch.nn.Module, weight_version: str) -> None:
        if policy is not self.model:  # a separate inference copy: copy the weights over
            self.model.load_state_dict(policy.state_dict())
        self.weight_version = weight_version

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                 temperature: float, seed: int | None) -> list[Rollout]:
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        try:
            return self._generate(model, device, prompt_ids, n, max_new_tokens, temperature, seed)
        finally:
            model.train(was_training)

    def _generate(self, model: torch.nn.Module, device: torch.device,
                  prompt_ids: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                  seed: int | None) -> list[Rollout]:
        seqs = [list(p) for p in prompt_ids for _ in range(n)]  # N = len(prompts) * n
        if any(not s for s in seqs):
            raise ValueError("empty prompt")
        N, P = len(seqs), max(len(s) for s in seqs)
        input_ids = torch.full((N, P), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((N, P), dtype=torch.long)
        for i, s in enumerate(seqs):                        # left padding
            input_ids[i, P - len(s):] = torch.tensor(s)
            attention_mask[i, P - len(s):] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [N, P]
        gen = torch.Generator(device=device)
        gen.manual_seed(seed if seed is not None else torch.seed())
        eos = torch.tensor(self.eos_ids, device=device)

        # transformers 5 renamed past_key_values to cache (the old name warns on every call)
        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters \
            else "past_key_values"
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids, use_cache=True)
        logits, past = out.logits[:, -1, :], out[cache_kw]       # [N, V]
        next_pos = position_ids[:, -1] + 1                          # [N]
        finished = torch.zeros(N, dtype=torch.bool, device=device)
        tokens, logps = [], []
        for _ in range(max_new_tokens):
            logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, V]
            tok = torch.multinomial(logprobs.exp(), 1, generator=gen).squeeze(1)  # [N]
            tok = torch.where(finished, self.pad_token_id, tok)
            tokens.append(tok)
            logps.append(logprobs.gather(1, tok.unsqueeze(1)).squeeze(1))
            finished = finished | torch.isin(tok, eos)
            if bool(finished.all()):
                break
            attention_mask = torch.cat([attention_mask, torch.ones_like(tok).unsqueeze(1)], 1)
            out = model(input_ids=tok.unsqueeze(1), attention_mask=attention_mask,
                        position_ids=next_pos.unsqueeze(1), use_cache=True, **{cache_kw: past})
            logits, past = out.logits[:, -1, :], out[cache_kw]
            next_pos = next_pos + 1

        tok_mat = torch.stack(tokens, 1).tolist()          # [N, t]
        lp_mat = torch.stack(logps, 1).tolist()
        eos_set = set(self.eos_ids)
        rollouts = []
        for i in range(N):
            ids, lps, reason = [], [], "length"
            for t, lp in zip(tok_mat[i], lp_mat[i], strict=True):
                ids.append(t)
                lps.append(lp)
                if t in eos_set:
                    reason = "stop"
                    break
            rollouts.append(Rollout(seqs[i], ids, lps, reason, self.weight_version))
        return rollouts


# ------------------------------------------------------------------------------------ SGLang

class SGLangRollout:
    """Client of an SGLang server's native API (python -m sglang.launch_server ...).

    What the SGLang sources and docs say (sgl-project/sglang, looked up for this module):
    - POST /generate takes GenerateReqInput: `input_ids` (one list or a batch of lists),
      `sampling_params` (one dict or one per request; SamplingParams has max_new_tokens,
      temperature, top_p, top_k, n, stop_token_ids, ignore_eos, sampling_seed, ...),
      `return_logprob`. A batch answers a list, one object per request, in order.
    - Each answer: {"text", "output_ids", "meta_info": {"id", "finish_reason",
      "prompt_tokens", "completion_tokens", "weight_version", "output_token_logprobs", ...}}
      with output_token_logprobs a list of [logprob, token_id, text-or-null] (tokenizer_manager
      builds meta_info; finish_reason comes from schedule_batch's FINISH_*.to_json():
      {"type": "stop", "matched": id-or-str} | {"type": "length", "length": n} |
      {"type": "abort", "message": ...}).
    - docs/advanced_features/sglang_for_rl.md: POST /update_weights_from_disk with
      {"model_path", "load_format", "abort_all_requests", "weight_version", "flush_cache", ...}
      answers {"success", "message", "num_paused_requests"}; "pause_generation --- update
      weights --- continue_generation is the correct execution flow"; POST /pause_generation
      {"mode": "abort" | "retract" | "in_place"} and POST /continue_generation.
    Weights travel through a directory both hosts see (save_pretrained into `staging_dir`)."""

    def __init__(self, url: str, *, staging_dir: str | Path | None = None, timeout: float = 600.0,
                 send_seed: bool = True, weight_version: str | None = None,
                 api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key  # the server's --api-key, sent as a Bearer token
        self.staging_dir = Path(staging_dir) if staging_dir else None
        self.timeout = timeout
        self.send_seed = send_seed  # sampling_seed is recent; off for servers that refuse it
        self.weight_version = weight_version

    def _post(self, path: str, payload: dict[str, Any] | None = None,
              allow_missing: bool = False) -> Any:
        data = json.dumps(payload or {}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=data, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            if allow_missing and e.code == 404:
                return None
            # The answer body stays in the worker's log: the error is stored on the job (read
            # by auditors, written into the audit chain) and must not carry what a server
            # answered — an internal page, a secret (issue 12). Only SGLang's own error shape,
            # a JSON object's "message" (the engine is an operator's rollout engine), is kept.
            body = e.read()[:2000]
            log.warning("SGLang %s%s answered %s: %r", self.url, path, e.code, body[:500])
            raise RolloutError(f"SGLang {path} answered HTTP {e.code} {_phrase(e.code)}"
                               f"{_sglang_message(body)}") from e
        except urllib.error.URLError as e:
            raise EngineUnreachable(f"SGLang at {self.url} unreachable: {e.reason}") from e
        return json.loads(body) if body.strip() else {}

    def generate(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                 temperature: float, seed: int | None) -> list[Rollout]:
        # Each prompt repeated n times (prompt-major) rather than sampling_params.n, so the
        # order is ours by construction; the radix cache shares the repeated prefix anyway.
        seqs = [list(p) for p in prompt_ids for _ in range(n)]
        params = []
        for i in range(len(seqs)):
            p: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature}
            if seed is not None and self.send_seed:
                p["sampling_seed"] = seed + i  # distinct per sample, reproducible per step
            params.append(p)
        answer = self._post("/generate", {"input_ids": seqs, "sampling_params": params,
                                          "return_logprob": True})
        if isinstance(answer, dict):
            answer = [answer]
        if len(answer) != len(seqs):
            raise RolloutError(f"SGLang answered {len(answer)} results for {len(seqs)} requests")
        return [self._parse(seq, item) for seq, item in zip(seqs, answer, strict=True)]

    def _parse(self, prompt: list[int], item: dict[str, Any]) -> Rollout:
        meta = item.get("meta_info") or {}
        reason = (meta.get("finish_reason") or {}).get("type") or "abort"
        if reason == "abort":
            msg = (meta.get("finish_reason") or {}).get("message", "no finish reason")
            raise RolloutError(f"SGLang aborted a generation: {msg}")
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise RolloutError("SGLang answer has no meta_info.output_token_logprobs "
                               "(was return_logprob honoured?)")
        ids = [int(t[1]) for t in triples]
        logprobs = [float(t[0]) for t in triples]
        version = meta.get("weight_version")
        return Rollout(prompt, ids, logprobs, reason,
                       str(version) if version is not None else self.weight_version)

    def update_weights_from_disk(self, path: str | Path, weight_version: str) -> None:
        """pause -> load weights from `path` -> continue; continue runs even if the load
        failed, so a bad checkpoint never leaves the server paused."""
        # "in_place" keeps requests in flight untouched; the synchronous trainer has none.
        paused = self._post("/pause_generation", {"mode": "in_place"}, allow_missing=True)
        try:
            result = self._post("/update_weights_from_disk",
                                {"model_path": str(path), "weight_version": weight_version,
                                 "flush_cache": True})
        finally:
            if paused is not None:
                self._post("/continue_generation", {}, allow_missing=True)
        if not (result or {}).get("success", False):
            raise RolloutError(f"SGLang refused the weights at {path}: "
                               f"{(result or {}).get('message', 'no message')}")
        self.weight_version = weight_version

    def sync_weights(self, policy: torch.nn.Module, weight_version: str) -> None:
        if self.staging_dir is None:
            raise RolloutError("SGLangRollout needs staging_dir (a directory the SGLang host "
                               "can read) to push weights")
        target = self.staging_dir / "policy"
        policy.save_pretrained(target)  # overwritten in place: the server reads it before
        self.update_weights_from_disk(target, weight_version)  # the next save
