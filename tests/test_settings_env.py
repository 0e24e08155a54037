"""One way to read settings: config/settings.py reads every setting from the environment, and
every variable it reads is documented in deploy/steward.env.sample. Django code elsewhere asks
django.conf.settings, never os.environ (the proxy, which never loads Django, reads its own in
proxy/)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_READ = re.compile(r"os\.environ\b|os\.getenv\b|environ\.get\(")
# file -> why it may touch os.environ (none of these reads a service setting).
ALLOWED = {
    # STEWARD_ENGINE_<NAME>_API_KEY names are made from the operator's engine list at run
    # time, so settings.py cannot define them one by one; the lookup asks settings first.
    "governance/engines.py": "per-engine credential names built at run time",
    # The password of one command invocation, not a setting of a service.
    "governance/management/commands/create_user.py": "STEWARD_PASSWORD of the command",
}


def test_django_code_reads_settings_not_the_environment():
    offenders = []
    for package in ("governance", "trainer"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/migrations/" in rel or rel in ALLOWED:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if ENV_READ.search(line) and "setdefault(\"DJANGO_SETTINGS_MODULE\"" not in line:
                    offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, ("read these through config/settings.py (or allow-list them here "
                           "with the reason):\n" + "\n".join(offenders))


def test_every_setting_read_from_the_environment_is_documented():
    source = (ROOT / "config/settings.py").read_text()
    names = set(re.findall(r"env_(?:int|float|bool)\(\s*\"([A-Z0-9_]+)\"", source))
    names |= set(re.findall(r"os\.environ(?:\.get)?[(\[]\s*\"([A-Z0-9_]+)\"", source))
    assert "STEWARD_TRAIN_STALE_SECONDS" in names and "STEWARD_SANITIZER_PRELOAD" in names
    sample = (ROOT / "deploy/steward.env.sample").read_text()
    documented = set(re.findall(r"^#?\s*([A-Z][A-Z0-9_]+)=", sample, re.MULTILINE))
    missing = sorted(names - documented - {"DJANGO_SECRET_KEY", "DJANGO_SETTINGS_MODULE"})
    assert not missing, f"add to deploy/steward.env.sample with a one-line comment: {missing}"


def test_the_two_settings_that_could_not_be_set_now_can(monkeypatch):
    import importlib

    import config.settings as module

    monkeypatch.setenv("STEWARD_TRAIN_STALE_SECONDS", "42")
    monkeypatch.setenv("STEWARD_SANITIZER_PRELOAD", "0")
    try:
        fresh = importlib.reload(module)
        assert fresh.STEWARD_TRAIN_STALE_SECONDS == 42
        assert fresh.STEWARD_SANITIZER_PRELOAD is False
    finally:
        monkeypatch.undo()
        importlib.reload(module)


def _import_settings_with(extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEWARD_")}
    env.update(extra)
    return subprocess.run([sys.executable, "-c", "import config.settings"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_bad_number_or_yes_no_names_the_variable_that_holds_it():
    """A typo in the env file stops the service with the variable's name and value, not with
    int()'s "invalid literal" (which names neither), and a yes/no typo is refused rather than
    read as "no" (STEWARD_SECURE_COOKIES=ture used to turn secure cookies off)."""
    bad_int = _import_settings_with({"STEWARD_WORKER_NICE": "ten"})
    assert bad_int.returncode != 0
    assert "ImproperlyConfigured: STEWARD_WORKER_NICE='ten' is not a whole number" in bad_int.stderr
    bad_float = _import_settings_with({"STEWARD_DETECTION_CACHE_MB": "1GB"})
    assert "STEWARD_DETECTION_CACHE_MB='1GB' is not a number (default 256.0)" in bad_float.stderr
    bad_bool = _import_settings_with({"STEWARD_SECURE_COOKIES": "ture"})
    assert bad_bool.returncode != 0
    assert "STEWARD_SECURE_COOKIES='ture' is not a yes/no value" in bad_bool.stderr
    # Empty keeps the default (an env file line left as `NAME=`); the spellings still work.
    fine = _import_settings_with({"STEWARD_WORKER_NICE": "", "STEWARD_SECURE_COOKIES": "Yes",
                                  "STEWARD_DEBUG": "off"})
    assert fine.returncode == 0, fine.stderr


def test_the_proxy_names_a_bad_number_too():
    # mitmdump runs addon.py as a script file, so the probe loads it the same way.
    probe = (
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('a', {str(ROOT / 'proxy/addon.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.Settings.from_env()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("STEWARD_")}
    env.update(STEWARD_UPSTREAM_TIMEOUT="10m", STEWARD_UPSTREAM_URL="http://127.0.0.1:9")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0
    assert "STEWARD_UPSTREAM_TIMEOUT='10m' is not a number (default 600.0)" in out.stderr
