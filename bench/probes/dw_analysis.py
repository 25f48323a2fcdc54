"""What torch's TTIR analysis of user Triton kernels (triton_kernel_wrap) says the dW step writes,
for each (ACCUMULATE, TMA_OUT): the root-cause check of the compiled-dW issue. Needs CUDA."""
import torch
from torch._higher_order_ops import triton_kernel_wrap as t

from lowerings.linear_logprobs.kernels.dw import _dw_step_kernel

ws = torch.empty(256, 512, device="cuda", dtype=torch.bfloat16)
xg = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
dw = torch.empty(512, 256, device="cuda", dtype=torch.bfloat16)
count = torch.empty(1, device="cuda", dtype=torch.int32)
analyze = getattr(t, "identify_accessed_tensors", None) or t.identify_mutated_tensors
print("torch", torch.__version__, "analysis:", analyze.__name__)
for acc in (False, True):
    for tma_out in (False, True):
        kw = dict(ws_ptr=ws, x_ptr=xg, dw_ptr=dw, count_ptr=count, row0=0, n_rows=256, v0=0, cols=512,
                  H=256, stride_ws=512, stride_x=256, stride_dw=256, n_cblocks=4, n_hblocks=2, n_later=0,
                  final=0, ACCUMULATE=acc, ON_DEVICE=False, DOT_PREC="tf32", USE_TMA=True, TMA_OUT=tma_out,
                  BLOCK_C=128, BLOCK_H=128, BLOCK_K=64, GROUP_C=8)
        print(f"ACCUMULATE={acc} TMA_OUT={tma_out}:", analyze(_dw_step_kernel, kw, {}))
