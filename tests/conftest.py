import torch

# Tiny models gain nothing from intra-op threads, and on a 2-core machine an OpenMP barrier that
# waits for a busy core costs ~10 ms per op; one thread keeps the suite fast and stable.
torch.set_num_threads(1)
