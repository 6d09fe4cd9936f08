import torch

# One thread: deterministic timings and no oversubscription when the suite shares the machine.
torch.set_num_threads(1)
torch.manual_seed(0)
