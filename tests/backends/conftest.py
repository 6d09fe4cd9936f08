import sys
from pathlib import Path

# Shared helpers (support.py) and model definitions live one directory up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
