"""`python manage.py train_demo [--steps N] [--seed S] [--out DIR]` (DESIGN.md).

GRPO on the CPU with a tiny Qwen2-style model and a character tokenizer built offline, on a toy
verifiable task (single-digit addition, exact-match reward), through the same trainer code path
as real jobs (trainer/). Progress lines, then the summary as JSON on the last line. No database:
all logic is in trainer.demo.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Run GRPO on a tiny offline model and a toy task (CPU; no database, no downloads)."
    # Nothing here needs the database or the system checks.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser) -> None:
        # trainer (torch, transformers) is imported in handle() only: `manage.py help` must work
        # on web and proxy hosts, which install no training extra.
        parser.add_argument("--steps", type=int, default=None,
                            help="GRPO steps (default: trainer.demo.DEFAULT_STEPS, 600)")
        parser.add_argument("--seed", type=int, default=0, help="seed (default %(default)s)")
        parser.add_argument("--out", default=None,
                            help="output directory for checkpoints (default: a new temp dir)")
        parser.add_argument("--warmup-steps", type=int, default=100,
                            help="format warm-up steps before GRPO (default %(default)s)")
        parser.add_argument("--resume", action="store_true",
                            help="continue from the latest checkpoint in --out")

    def handle(self, *args, **options) -> None:
        try:
            from trainer.demo import DEFAULT_STEPS, run_demo
        except ImportError as e:
            raise CommandError(f"training needs the 'train' extra (torch, transformers): {e}. "
                               "Install it with: uv sync --extra train") from e

        if options["steps"] is None:
            options["steps"] = DEFAULT_STEPS
        if options["steps"] < 1:
            raise CommandError("--steps must be >= 1")
        if options["resume"] and not options["out"]:
            raise CommandError("--resume needs --out (the directory holding the checkpoints)")

        def log(line: str) -> None:
            self.stdout.write(line)
            self.stdout.flush()

        run_demo(steps=options["steps"], seed=options["seed"], out_dir=options["out"],
                 warmup_steps=options["warmup_steps"], log=log, resume=options["resume"])
