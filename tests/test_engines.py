"""The operator's engines (issue 12, items 2 and 3): every URL a person gives the control plane
or a training job names an engine the operator listed (wire/engines.py), each engine gets
only its own credential, a rollout engine never serves agents, and one URL check refuses
file:// and every other non-http(s) scheme. The live-proxy half (a canary route is followed
only to a listed engine, with its credential) is in tests/test_routing.py."""

from __future__ import annotations

import pytest
from aiohttp import web

from evolution import services as svc
from evolution.models import Candidate, EvolutionPolicy, PolicyRoute
from evolution.tasks import run_gates
from governance import services as gov
from governance.services import ServiceError
from tests.live import serve_app
from tests.test_evolution import FakeModels, tiny_checkpoint, var_dir  # noqa: F401 - fixture
from wire.engines import EngineError, Engines, validate_http_url

HOSTILE_URLS = ["file:///etc/passwd", "gopher://127.0.0.1:6379/_FLUSHALL", "ftp://x/y",
                "javascript:alert(1)", "http:///no-host", "http://user:pw@engine:30000",
                "http://engine:30000/?q=1", "http://engine:30000/#f", "http://engine:port",
                "http://engine:30000/a b", "http://engine:30000/\r\nX-Injected: 1", "", "   ",
                "//engine:30000", "engine:30000"]


@pytest.mark.parametrize("url", HOSTILE_URLS)
def test_the_one_url_check_refuses_other_schemes_and_smuggled_parts(url):
    with pytest.raises(EngineError):
        validate_http_url(url)


def test_the_one_url_check_keeps_an_http_engine_address():
    assert validate_http_url(" https://Engine.example:8443/v1/ ") == "https://Engine.example:8443/v1"
    assert validate_http_url("http://10.0.0.5:30000") == "http://10.0.0.5:30000"


def lookup(values: dict):
    return values.get


def test_engines_from_the_operators_settings():
    found = Engines(lookup({
        "STEWARD_ENGINE_ALLOWLIST": "vllm-b=http://10.0.0.6:8000/v1, Cand.A=http://10.0.0.5:30000",
        "STEWARD_ENGINE_VLLM_B_API_KEY": "sk-b",
        "STEWARD_UPSTREAM_URL": "http://provider.example/v1",
        "STEWARD_UPSTREAM_API_KEY": "sk-provider",
        "STEWARD_SGLANG_URL": "http://10.0.0.9:30000",
        "STEWARD_ROLLOUT_ENGINES": "train=http://10.0.0.7:30000 prod=http://10.0.0.9:30000/",
        "STEWARD_ENGINE_TRAIN_API_KEY": "sk-train"}))
    assert sorted(found.candidates) == ["cand.a", "upstream", "vllm-b"]
    assert found.candidate("vllm-b").api_key == "sk-b"
    assert found.candidate("http://10.0.0.6:8000").name == "vllm-b"  # /v1 or not: one engine
    assert found.candidate("upstream").api_key == "sk-provider"
    assert found.candidate("cand.a").api_key == ""  # no credential configured: none sent
    assert found.for_url("http://evil.example") is None
    with pytest.raises(EngineError, match="not a free URL"):
        found.candidate("http://evil.example:8000")
    with pytest.raises(EngineError, match="http"):
        found.candidate("file:///etc/passwd")
    assert found.rollout_engine("").name == "train"  # the first listed is the default
    assert found.rollout_engine("train").api_key == "sk-train"
    with pytest.raises(EngineError, match="also serves agents"):
        found.rollout_engine("prod")
    with pytest.raises(EngineError, match="not a free URL"):
        found.rollout_engine("http://10.0.0.8:30000")
    for bad in ["no-equals-sign", "a=http://x a=http://y", "A B=http://x",
                "a=http://x b=http://x/", "a=file:///etc"]:
        with pytest.raises(EngineError):
            Engines(lookup({"STEWARD_ENGINE_ALLOWLIST": bad}))
    assert "sk-" not in repr(found.candidate("vllm-b"))


# --- evolution: candidates and the baseline name listed engines ---------------------------


def test_a_steward_cannot_point_a_candidate_or_the_baseline_at_a_free_url(tenant, people,
                                                                         settings):
    users, _ = people
    settings.STEWARD_ENGINE_ALLOWLIST = "cand-b=http://10.0.0.6:8000"
    agent = gov.ensure_agent("system:test", tenant, "bot")
    for url in ["http://attacker.example:8000", "file:///etc/passwd", "http://10.0.0.6:8001"]:
        with pytest.raises(ServiceError):
            svc.propose_candidate(users["steward"], tenant, agent=agent, upstream_url=url,
                                  model="m")
        with pytest.raises(ServiceError):
            svc.set_evolution_policy(users["steward"], tenant, baseline_upstream_url=url)
    assert not Candidate.objects.exists()
    assert not EvolutionPolicy.objects.filter(tenant=tenant).exclude(
        baseline_upstream_url="").exists()
    # A listed engine, by name or by its URL, is stored as its URL.
    cand = svc.propose_candidate(users["steward"], tenant, agent=agent, upstream_url="cand-b",
                                 model="m")
    assert cand.upstream_url == "http://10.0.0.6:8000"
    policy = svc.set_evolution_policy(users["admin"], tenant,
                                      baseline_upstream_url="http://10.0.0.6:8000/")
    assert policy.baseline_upstream_url == "http://10.0.0.6:8000"


def test_the_console_offers_engines_and_refuses_a_free_url(client, tenant, people, settings,
                                                          var_dir):  # noqa: F811
    users, _ = people
    settings.STEWARD_ENGINE_ALLOWLIST = "cand-b=http://10.0.0.6:8000"
    ckpt, agent = tiny_checkpoint(tenant, people)
    from tests.test_training_jobs import make_version

    # A held-out split exists, so the only reason left to refuse is the free URL.
    make_version(tenant, people, name="held-out")
    client.force_login(users["steward"])
    page = client.get("/evolution/").content.decode()
    assert '<select id="pc-url" name="upstream_url">' in page
    assert '<option value="cand-b">cand-b</option>' in page
    assert 'type="url"' not in page
    r = client.post("/evolution/propose/", {"checkpoint": ckpt.pk, "agent": agent.pk,
                                            "upstream_url": "http://attacker.example:8000",
                                            "model": "m"}, follow=True)
    assert "Not proposed" in r.content.decode() and "not a free URL" in r.content.decode()
    assert not Candidate.objects.exists()
    r = client.post("/evolution/propose/", {"checkpoint": ckpt.pk, "agent": agent.pk,
                                            "upstream_url": "cand-b", "model": "m"})
    assert r.status_code == 302
    assert Candidate.objects.get().upstream_url == "http://10.0.0.6:8000"
    # An outsider (another tenant's admin) sees none of it.
    client.force_login(users["outsider"])
    assert client.get(f"/evolution/candidates/{Candidate.objects.get().pk}/").status_code == 404


def test_a_canary_route_names_a_listed_engine(tenant, settings):
    from evolution.canary import start_canary

    settings.STEWARD_ENGINE_ALLOWLIST = "cand-b=http://10.0.0.6:8000"
    agent = gov.ensure_agent("system:test", tenant, "bot")
    for url in ["http://attacker.example", "gopher://10.0.0.6:8000"]:
        with pytest.raises(ServiceError):
            start_canary("system:test", tenant, agent, candidate_ref="c", share=0.5,
                         upstream_url=url, model="m")
    assert not PolicyRoute.objects.exists()
    route = start_canary("system:test", tenant, agent, candidate_ref="c", share=0.5,
                         upstream_url="cand-b", model="m")
    assert route.candidate_upstream_url == "http://10.0.0.6:8000"


@pytest.fixture
def two_engines(settings, monkeypatch):
    """The provider upstream (the baseline) and a candidate engine, each a fake model server
    recording the credentials it is sent."""
    provider, candidate = FakeModels(), FakeModels()
    stops = []
    urls = []
    for fake in (provider, candidate):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", fake.chat)
        url, stop = serve_app(app)
        urls.append(url)
        stops.append(stop)
    settings.STEWARD_UPSTREAM_URL = urls[0]
    settings.STEWARD_UPSTREAM_API_KEY = "sk-provider-secret"
    monkeypatch.setenv("STEWARD_UPSTREAM_API_KEY", "sk-provider-secret")
    settings.STEWARD_ENGINE_ALLOWLIST = f"cand-b={urls[1]}"
    monkeypatch.setenv("STEWARD_ENGINE_CAND_B_API_KEY", "sk-cand-b")
    yield provider, candidate, urls[1]
    for stop in stops:
        stop()


def propose_served_candidate(tenant, people, url: str) -> Candidate:
    """A steward's candidate served at `url`, compared with the provider's "safe-prod" on a
    held-out approved version."""
    from tests.test_training_jobs import make_version

    users, _ = people
    version, _ = make_version(tenant, people, name="heldout", n=6)
    agent = gov.ensure_agent("system:test", tenant, "bot-heldout")
    svc.set_evolution_policy(users["steward"], tenant, baseline_model="safe-prod",
                             eval_version=version)
    return svc.propose_candidate(users["steward"], tenant, agent=agent, upstream_url=url,
                                 model="safe-v2")


def test_the_gates_send_each_engine_its_own_credential(tenant, people, two_engines,
                                                       var_dir):  # noqa: F811
    """The provider's key goes to the provider only: the candidate engine is evaluated with
    its own credential (it used to receive STEWARD_UPSTREAM_API_KEY with every eval prompt)."""
    provider, candidate, candidate_url = two_engines
    cand = propose_served_candidate(tenant, people, candidate_url)
    run_gates(cand.pk)
    assert candidate.requests and provider.requests
    assert candidate.credentials == {"Bearer sk-cand-b"}
    assert provider.credentials == {"Bearer sk-provider-secret"}


def test_a_candidate_whose_engine_was_delisted_is_stopped_before_any_request(
        tenant, people, two_engines, settings, var_dir):  # noqa: F811
    provider, candidate, candidate_url = two_engines
    cand = propose_served_candidate(tenant, people, candidate_url)
    settings.STEWARD_ENGINE_ALLOWLIST = ""  # the operator removes the engine
    assert run_gates(cand.pk) == "failed"
    cand.refresh_from_db()
    assert cand.status == "failed" and "not a free URL" in cand.reason
    assert candidate.requests == [] and provider.requests == []
