import sys
from pathlib import Path

# Spawned worker processes import test helpers by module name.
sys.path.insert(0, str(Path(__file__).parent))
