import sys
from pathlib import Path

import torch

# Shared helpers (support.py) live here; test folders mirror the package below it.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# One thread: deterministic timings and no oversubscription when the suite shares the machine.
torch.set_num_threads(1)
torch.manual_seed(0)
