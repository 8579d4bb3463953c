"""Stand-in for sglang-kernel's sgl_kernel (tests only; see ../README.md): fused_add_rmsnorm as
SGLang's RMSNorm calls it, in place (input becomes the normed output, residual becomes
input + residual), computed with torch."""

import torch


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    residual.add_(input)
    y = residual.float()
    input.copy_((y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(input.dtype))
