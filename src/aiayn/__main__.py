import sys

from aiayn.cli import entry_point

sys.exit(entry_point())
