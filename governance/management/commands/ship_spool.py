"""`manage.py ship_spool [--once] [--interval S]` — ship the proxy's spool into PostgreSQL."""

from __future__ import annotations

import json
import signal

from django.core.management.base import BaseCommand

from governance.capture.shipper import Shipper


class Command(BaseCommand):
    help = (
        "Ship finished exchanges from the proxy's local spool (STEWARD_SPOOL_DIR) into "
        "PostgreSQL, idempotently by flow id, and queue step building on Celery. Runs until "
        "stopped (SIGTERM/SIGINT finish the current batch); with --once, ships what is there "
        "and prints the counts as JSON. When the database is down it keeps retrying with a "
        "bounded backoff; nothing in the spool is lost or shipped twice."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("--once", action="store_true",
                            help="ship what is in the spool now, print counts, exit")
        parser.add_argument("--interval", type=float, default=0.5,
                            help="seconds to wait when the spool is empty (default 0.5)")
        parser.add_argument("--spool-dir", default=None,
                            help="spool directory (default: STEWARD_SPOOL_DIR)")
        parser.add_argument("--no-enqueue", action="store_true",
                            help="do not queue build_steps (beat's build_pending_steps will)")

    def handle(self, *args, **options) -> None:
        from governance.capture.shipper import default_enqueue

        shipper = Shipper(options["spool_dir"],
                          enqueue=None if options["no_enqueue"] else default_enqueue)
        stop = {"now": False}

        def request_stop(signum, frame) -> None:
            stop["now"] = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        self.stderr.write(f"ship_spool: shipping {shipper.spool_dir}")
        counts = shipper.run(interval=options["interval"], once=options["once"],
                             should_stop=lambda: stop["now"])
        self.stdout.write(json.dumps(counts.as_dict()))
