"""The data subject a person searches for never reaches the web access log (issue 12, item 9).

The real web process: gunicorn started with the appliance's own command line
(config.cli.service_argv("web", ...)), its access log in a file, a person logged in over HTTP.
The console's search form POSTs the subject and is redirected to an address with a signed
reference only; a hand-made GET with `?subject=` (or a login redirect carrying it in `next=`)
is still served, but the access log records paths without query strings."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from config.cli import ServiceConfig, service_argv
from tests.live import database_url_from_django, free_port, wait_for_port

REPO = Path(__file__).resolve().parent.parent
SUBJECT = "maria.lopez@example.com"
PASSWORD = "correct horse battery staple"

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def gunicorn_web(transactional_db, tmp_path):
    """(base url, access log path) of a real `steward run web` (gunicorn) on the test database."""
    port = free_port()
    log = tmp_path / "web-access.log"
    cfg = ServiceConfig(var_dir=tmp_path / "var", host="127.0.0.1", web_port=port,
                        proxy_port=free_port(), upstream="", access_log=str(log))
    argv = service_argv("web", cfg) + ["--workers", "1"]
    env = {**os.environ, "DATABASE_URL": database_url_from_django(),
           "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONUNBUFFERED": "1",
           "STEWARD_VAR_DIR": str(tmp_path / "var"),
           "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH")]
                                         if p)}
    out = open(tmp_path / "web.out", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, timeout=60, process=process)
        yield f"http://127.0.0.1:{port}", log
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        out.close()


def _login(base: str, username: str) -> httpx.Client:
    client = httpx.Client(base_url=base, follow_redirects=False, timeout=30)
    client.get("/login/")
    token = client.cookies["csrftoken"]
    r = client.post("/login/", data={"username": username, "password": PASSWORD,
                                     "csrfmiddlewaretoken": token},
                    headers={"Referer": base + "/login/"})
    assert r.status_code == 302, r.text[:500]
    return client


def _access_log(log: Path, expect: int) -> str:
    """The access log once it holds `expect` lines (gunicorn writes after each response)."""
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if len(text.splitlines()) >= expect:
            break
        time.sleep(0.1)
    return text


def test_searched_subject_is_not_in_the_access_log(gunicorn_web, make_member, settings):
    base, log = gunicorn_web
    # The web process checks passwords with the production hashers, not the tests' fast one.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.PBKDF2PasswordHasher"]
    make_member("compliance", "olivia")
    client = _login(base, "olivia")
    csrf = client.cookies["csrftoken"]
    headers = {"Referer": base + "/trajectories/", "X-CSRFToken": csrf}

    # The console's form: a POST, answered 303 with the signed reference, never the subject.
    posted = client.post("/trajectories/", data={"subject": SUBJECT, "agent": ""},
                         headers=headers)
    assert posted.status_code == 303, posted.text[:500]
    location = posted.headers["Location"]
    assert "subject_ref=" in location and "maria" not in location.lower()
    page = client.get(location, headers={"Referer": base + "/trajectories/"})
    assert page.status_code == 200 and "Filtered by a data subject" in page.text
    # htmx's POST: the results fragment, the pushed address holds the reference only.
    fragment = client.post("/trajectories/", data={"subject": SUBJECT},
                           headers={**headers, "HX-Request": "true", "HX-Target": "results"})
    assert fragment.status_code == 200
    assert "maria" not in fragment.headers["HX-Push-Url"].lower()

    # A hand-made GET with the subject in the query, and the same address with its Referer
    # pointing at it: served (redirected to the reference) ...
    typed = client.get("/trajectories/", params={"subject": SUBJECT},
                       headers={"Referer": f"{base}/trajectories/?subject={SUBJECT}"})
    assert typed.status_code in (302, 303)
    # ... and an anonymous one, whose login redirect carries it in `next=`.
    anon = httpx.get(f"{base}/trajectories/", params={"subject": SUBJECT})
    assert anon.status_code == 302 and "next=" in anon.headers["Location"]
    followed = httpx.get(base + anon.headers["Location"])
    assert followed.status_code == 200

    text = _access_log(log, expect=9)
    assert "/trajectories/" in text and "/login/" in text, text
    assert "maria" not in text.lower() and "example.com" not in text, text
    assert "?" not in "".join(re.findall(r'"(?:GET|POST|HEAD) [^"]*"', text)), text


def test_access_log_keeps_the_request_itself(gunicorn_web):
    """What an operator needs stays: method, path, status, size, user agent."""
    base, log = gunicorn_web
    assert httpx.get(f"{base}/api/v1/trajectories/?agent=x",
                     headers={"User-Agent": "probe/1.0"}).status_code == 401
    text = _access_log(log, expect=1)
    assert re.search(r'"GET /api/v1/trajectories/ HTTP/1\.1" 401 \d+ "-" "probe/1\.0"', text), \
        text

