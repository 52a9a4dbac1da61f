"""Stand-in: on NPU this routes torch.cuda.* to torch.npu; here there is no device (../../README.md)."""

import torch

torch.cuda.set_device = lambda *args, **kwargs: None
torch.cuda.empty_cache = lambda: None
torch.cuda.memory._record_memory_history = lambda *args, **kwargs: None
