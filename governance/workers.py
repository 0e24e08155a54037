"""Which Celery workers are up, for the console and `steward up`.

Every worker runs the Heartbeat bootstep (config/celery.py): after the worker is ready it
upserts a WorkerHeartbeat row (host name, the queues it consumes) every HEARTBEAT_SECONDS from
a thread of the worker's main process, and deletes the row on a clean stop. A worker killed
without a clean stop is taken as gone once its row is STALE_AFTER_SECONDS old. This works on
every broker, where Celery's inspect/ping needs one with broadcast (not kombu's SQLAlchemy
transport, the embedded default).

A worker loads the sanitizer (spaCy) before its pool forks (governance/tasks.py,
worker_init), and the heartbeat starts only once the worker is ready, so a worker's first
heartbeat means it can build steps at once: `steward up` waits for that before its banner.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import bootsteps

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10.0
STALE_AFTER_SECONDS = 3 * HEARTBEAT_SECONDS


def _consumed_queues(app: Any) -> list[str]:
    return sorted(app.amqp.queues.consume_from or app.amqp.queues)


def beat(hostname: str, queues: list[str], started_at: Any) -> None:
    from django.db import close_old_connections
    from django.utils import timezone

    from governance.models import WorkerHeartbeat

    close_old_connections()
    WorkerHeartbeat.objects.update_or_create(
        hostname=hostname,
        defaults={"queues": queues, "started_at": started_at, "seen_at": timezone.now()})


def forget(hostname: str) -> None:
    from governance.models import WorkerHeartbeat

    WorkerHeartbeat.objects.filter(hostname=hostname).delete()


def workers_listening(queue: str) -> list[str]:
    """Host names of the workers up (a fresh heartbeat) that consume `queue`."""
    from datetime import timedelta

    from django.utils import timezone

    from governance.models import WorkerHeartbeat

    fresh = timezone.now() - timedelta(seconds=STALE_AFTER_SECONDS)
    return sorted(WorkerHeartbeat.objects.filter(seen_at__gte=fresh, queues__contains=[queue])
                  .values_list("hostname", flat=True))


class Heartbeat(bootsteps.StartStopStep):
    """The worker's heartbeat thread (a consumer step, so it starts once the worker is
    connected and its pool is up)."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, parent: Any) -> None:
        from django.utils import timezone

        hostname = parent.hostname
        queues = _consumed_queues(parent.app)
        started_at = timezone.now()

        def run() -> None:
            while not self._stop.is_set():
                try:
                    beat(hostname, queues, started_at)
                except Exception:  # noqa: BLE001 - the database may be down; try again later
                    log.warning("worker heartbeat failed", exc_info=True)
                self._stop.wait(HEARTBEAT_SECONDS)

        self._stop.clear()
        self._thread = threading.Thread(target=run, name="steward-heartbeat", daemon=True)
        self._thread.start()
        self._hostname = hostname

    def stop(self, parent: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
            try:
                forget(self._hostname)
            except Exception:  # noqa: BLE001 - going away anyway; the row goes stale
                log.warning("could not remove the worker heartbeat", exc_info=True)
