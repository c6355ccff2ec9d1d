"""``python -m dapple_lightning.schedule S M [NAME]``: draw a schedule as a table."""

import sys

from dapple_lightning.schedule import grid, schedule

s, m = (int(a) for a in sys.argv[1:3])
name = sys.argv[3] if len(sys.argv) > 3 else "dapple"
print(grid(schedule(name, s, m)))
