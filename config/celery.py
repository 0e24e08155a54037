"""Celery app. Queues: capture (build steps), sanitize, gpu (training)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

app = Celery("steward")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# Every worker reports itself (governance/workers.py: the console's "is a gpu worker up?") and,
# on the capture queue, loads the sanitizer before its pool forks.
from governance.workers import Heartbeat  # noqa: E402

app.steps["consumer"].add(Heartbeat)
