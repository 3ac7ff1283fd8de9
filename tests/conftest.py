import os

import torch

# Triton kernels run through the interpreter on machines without a GPU. It must be set before
# triton is imported (kernel.py reads it when its kernels are decorated).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
