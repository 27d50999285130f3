"""python -m scheduler_lite: the scheduler-lite command line (scheduler_lite/cli.py)."""

from scheduler_lite.cli import main

raise SystemExit(main())
