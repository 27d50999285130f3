import sys

from scheduler_lite.sim.cli import main

sys.exit(main())
