"""Rollout backends: HFRollout on the tiny model; SGLangRollout against a fake SGLang server
(aiohttp, started here) that answers in the real server's shapes."""

from __future__ import annotations

import random
import socket
import uuid
from pathlib import Path

import pytest
import torch
from aiohttp import web

from tests.live import serve_app
from trainer.grpo import token_logprobs
from trainer.rollout import HFRollout, Rollout, RolloutBackend, RolloutError, SGLangRollout


@pytest.fixture(scope="module")
def tiny():
    from trainer.tiny import build_tiny

    model, tok = build_tiny(seed=1)
    model.eval()
    return model, tok


# ---------------------------------------------------------------------------------------- HF

def test_hf_rollout_shapes_order_and_finish_reasons(tiny):
    model, tok = tiny
    backend = HFRollout(model, tok.eos_token_id, tok.pad_token_id, weight_version="7")
    assert isinstance(backend, RolloutBackend)
    prompts = [tok("3+4=")["input_ids"], tok("12+30=")["input_ids"]]  # different lengths
    out = backend.generate(prompts, n=3, max_new_tokens=5, temperature=1.0, seed=11)
    assert len(out) == 6
    assert [r.prompt_ids for r in out] == [prompts[0]] * 3 + [prompts[1]] * 3  # prompt-major
    for r in out:
        assert isinstance(r, Rollout) and r.weight_version == "7"
        assert 1 <= len(r.completion_ids) <= 5
        assert len(r.behaviour_logprobs) == len(r.completion_ids)
        assert tok.pad_token_id not in r.completion_ids
        if r.finish_reason == "stop":
            assert r.completion_ids[-1] == tok.eos_token_id
        else:
            assert r.finish_reason == "length" and len(r.completion_ids) == 5
            assert tok.eos_token_id not in r.completion_ids
    # seeded: the same seed samples the same tokens, another seed others
    again = backend.generate(prompts, n=3, max_new_tokens=5, temperature=1.0, seed=11)
    assert [r.completion_ids for r in again] == [r.completion_ids for r in out]
    other = backend.generate(prompts, n=3, max_new_tokens=5, temperature=1.0, seed=12)
    assert [r.completion_ids for r in other] != [r.completion_ids for r in out]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_hf_behaviour_logprobs_equal_the_trainers_recomputation(tiny, temperature):
    """The sampler's log-probs are the ones the trainer computes for the same tokens (with the
    prompt alone, unpadded): left padding and the KV cache change nothing."""
    model, tok = tiny
    backend = HFRollout(model, tok.eos_token_id, tok.pad_token_id)
    prompts = [tok("7=")["input_ids"], tok("99+99=")["input_ids"]]
    for r in backend.generate(prompts, n=2, max_new_tokens=6, temperature=temperature, seed=3):
        ids = torch.tensor([r.prompt_ids + r.completion_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, len(r.prompt_ids) - 1:-1] / temperature
        lp = token_logprobs(logits, ids[:, len(r.prompt_ids):])[0]
        assert torch.allclose(lp, torch.tensor(r.behaviour_logprobs), atol=1e-5)


def test_hf_sync_weights_copies_into_a_separate_engine_model(tiny):
    from trainer.tiny import build_tiny

    policy, tok = tiny
    engine_model, _ = build_tiny(seed=99)
    backend = HFRollout(engine_model, tok.eos_token_id, tok.pad_token_id)
    backend.sync_weights(policy, "3")
    assert backend.weight_version == "3"
    assert torch.equal(engine_model.model.embed_tokens.weight, policy.model.embed_tokens.weight)


# ------------------------------------------------------------------------------- fake SGLang

class FakeSGLang:
    """Native SGLang HTTP API, as its sources describe it (see trainer/rollout.py): /generate
    with input_ids + sampling_params + return_logprob, answering a list of
    {"text", "output_ids", "meta_info": {..., "finish_reason", "weight_version",
    "output_token_logprobs": [[logprob, token_id, null], ...]}}; /pause_generation,
    /continue_generation, /update_weights_from_disk with weight_version."""

    def __init__(self, vocab: int, eos: int, *, support_pause: bool = True) -> None:
        self.vocab, self.eos, self.support_pause = vocab, eos, support_pause
        self.weight_version = "default"
        self.paused = False
        self.calls: list[tuple[str, dict]] = []
        self.abort_next = False
        self.last_auth: str | None = None

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/generate", body))
        self.last_auth = request.headers.get("Authorization")
        if self.paused:
            return web.json_response({"error": "paused"}, status=503)
        if not body.get("return_logprob"):
            return web.json_response({"error": "test expects return_logprob"}, status=400)
        ids = body["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        batch = [ids] if single else ids
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(batch)
        out = []
        for prompt, p in zip(batch, params, strict=True):
            rng = random.Random(p.get("sampling_seed", 0))
            toks = []
            for _ in range(p["max_new_tokens"]):
                toks.append(self.eos if rng.random() < 0.3 else rng.randrange(3, self.vocab))
                if toks[-1] == self.eos:
                    break
            finish = {"type": "stop", "matched": self.eos} if toks[-1] == self.eos else \
                {"type": "length", "length": len(toks)}
            if self.abort_next:
                finish = {"type": "abort", "message": "Abort in waiting queue"}
            out.append({
                "text": "x" * len(toks),
                "output_ids": toks,
                "meta_info": {
                    "id": uuid.uuid4().hex, "finish_reason": finish,
                    "prompt_tokens": len(prompt), "completion_tokens": len(toks),
                    "cached_tokens": 0, "weight_version": self.weight_version,
                    "output_token_logprobs": [[-0.1 * (i + 1), t, None]
                                              for i, t in enumerate(toks)],
                    "e2e_latency": 0.01,
                },
            })
        return web.json_response(out[0] if single else out)

    async def pause(self, request: web.Request) -> web.Response:
        self.calls.append(("/pause_generation", await request.json()))
        if not self.support_pause:
            raise web.HTTPNotFound()
        self.paused = True
        return web.json_response({})

    async def cont(self, request: web.Request) -> web.Response:
        self.calls.append(("/continue_generation", await request.json()))
        if not self.support_pause:
            raise web.HTTPNotFound()
        self.paused = False
        return web.json_response({})

    async def update(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(("/update_weights_from_disk", body))
        if self.support_pause and not self.paused:
            return web.json_response({"success": False, "message": "not paused"}, status=400)
        path = Path(body["model_path"])
        if not (path / "config.json").is_file():
            return web.json_response({"success": False, "message": f"no model at {path}",
                                      "num_paused_requests": 0}, status=400)
        self.weight_version = body.get("weight_version") or self.weight_version
        return web.json_response({"success": True, "message": "Succeeded to update model "
                                  "weights.", "num_paused_requests": 0})

    def paths(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def fake_sglang(tiny):
    """Start a FakeSGLang on a free port in a background event loop; yields (server, url)."""
    _, tok = tiny
    servers = []

    def start(**kwargs):
        fake = FakeSGLang(len(tok), tok.eos_token_id, **kwargs)
        app = web.Application()
        app.router.add_post("/generate", fake.generate)
        app.router.add_post("/pause_generation", fake.pause)
        app.router.add_post("/continue_generation", fake.cont)
        app.router.add_post("/update_weights_from_disk", fake.update)
        url, stop = serve_app(app)
        servers.append(stop)
        return fake, url

    yield start
    for stop in servers:
        stop()


def test_sglang_generate_parses_the_native_answer(fake_sglang):
    fake, url = fake_sglang()
    backend = SGLangRollout(url)
    assert isinstance(backend, RolloutBackend)
    prompts = [[5, 6, 7], [8, 9]]
    out = backend.generate(prompts, n=3, max_new_tokens=4, temperature=0.8, seed=100)
    path, body = fake.calls[-1]
    assert path == "/generate"
    assert body["input_ids"] == [[5, 6, 7]] * 3 + [[8, 9]] * 3
    assert body["return_logprob"] is True
    assert [p["sampling_seed"] for p in body["sampling_params"]] == list(range(100, 106))
    assert all(p["max_new_tokens"] == 4 and p["temperature"] == 0.8
               for p in body["sampling_params"])
    assert len(out) == 6 and [r.prompt_ids for r in out] == body["input_ids"]
    for r in out:
        assert r.weight_version == "default"
        assert r.behaviour_logprobs == pytest.approx([-0.1 * (i + 1)
                                                      for i in range(len(r.completion_ids))])
        assert r.finish_reason == ("stop" if r.completion_ids[-1] == fake.eos else "length")
    assert {r.finish_reason for r in out} == {"stop", "length"}  # this seed shows both
    assert fake.last_auth is None
    # no seed: no sampling_seed sent; the server's --api-key goes as a Bearer token
    SGLangRollout(url, api_key="k-1").generate([[5]], n=1, max_new_tokens=2, temperature=1.0,
                                               seed=None)
    assert "sampling_seed" not in fake.calls[-1][1]["sampling_params"][0]
    assert fake.last_auth == "Bearer k-1"


def test_sglang_abort_and_unreachable_are_errors(fake_sglang):
    fake, url = fake_sglang()
    fake.abort_next = True
    with pytest.raises(RolloutError, match="aborted"):
        SGLangRollout(url).generate([[5]], n=2, max_new_tokens=2, temperature=1.0, seed=0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    with pytest.raises(RolloutError, match="unreachable"):
        SGLangRollout(dead, timeout=5).generate([[5]], n=1, max_new_tokens=2, temperature=1.0,
                                                seed=0)


def test_sglang_weight_push_pauses_updates_and_continues(fake_sglang, tiny, tmp_path):
    fake, url = fake_sglang()
    policy, _ = tiny
    backend = SGLangRollout(url, staging_dir=tmp_path)
    backend.sync_weights(policy, "5")
    assert fake.paths() == ["/pause_generation", "/update_weights_from_disk",
                            "/continue_generation"]
    update = fake.calls[1][1]
    assert update["weight_version"] == "5"
    assert Path(update["model_path"]) == tmp_path / "policy"
    assert (tmp_path / "policy" / "config.json").is_file()  # save_pretrained output
    assert not fake.paused
    out = backend.generate([[5]], n=2, max_new_tokens=2, temperature=1.0, seed=1)
    assert {r.weight_version for r in out} == {"5"}


def test_sglang_refused_weights_raise_and_still_continue(fake_sglang, tmp_path):
    fake, url = fake_sglang()
    backend = SGLangRollout(url)
    with pytest.raises(RolloutError, match="no model at"):
        backend.update_weights_from_disk(tmp_path / "missing", "9")
    assert fake.paths()[-1] == "/continue_generation" and not fake.paused
    assert fake.weight_version == "default"
    with pytest.raises(RolloutError, match="staging_dir"):
        backend.sync_weights(torch.nn.Linear(1, 1), "9")


def test_sglang_without_pause_endpoints(fake_sglang, tiny, tmp_path):
    """Older servers answer 404 to /pause_generation: the update goes ahead without it."""
    fake, url = fake_sglang(support_pause=False)
    policy, _ = tiny
    SGLangRollout(url, staging_dir=tmp_path).sync_weights(policy, "2")
    assert fake.paths() == ["/pause_generation", "/update_weights_from_disk"]
    assert fake.weight_version == "2"


def test_training_loop_drives_sglang_backend(fake_sglang, tmp_path):
    """Two GRPO steps with SGLang as the rollout engine: the loop re-scores the engine's tokens
    with the policy and pushes weights (versions 0, 1, 2) between steps."""
    from trainer.config import GRPOConfig
    from trainer.loop import Task, train
    from trainer.tiny import build_tiny

    fake, url = fake_sglang()
    policy, tok = build_tiny(seed=2)
    tasks = [Task(tok(f"{i}+1=")["input_ids"], {"answer": str(i + 1)}, str(i)) for i in range(4)]
    config = GRPOConfig(output_dir=str(tmp_path / "run"), train_batch_size=2, group_size=4,
                        max_prompt_length=8, max_response_length=4, lr=1e-3, total_steps=2,
                        save_every=0, device="cpu", drop_zero_spread_groups=False)
    backend = SGLangRollout(url, staging_dir=tmp_path / "staging")
    history = train(config, policy, tok, tasks, lambda text, ref: float(len(text)), backend)
    versions = [b["weight_version"] for p, b in fake.calls if p == "/update_weights_from_disk"]
    assert versions == ["0", "1", "2"]
    assert [m["step"] for m in history] == [1, 2]
    assert all(m["grad_norm"] > 0 for m in history)  # the update ran on SGLang's samples
    generates = [b for p, b in fake.calls if p == "/generate"]
    assert len(generates) == 2 and all(len(b["input_ids"]) == 8 for b in generates)
