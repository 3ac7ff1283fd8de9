"""FP8 weights: the block format of Qwen's FP8 checkpoints, quantizing a 16-bit checkpoint into it at load, and
the linear layer that multiplies by it without writing the weight out in 16 bits.

The format (Qwen/Qwen3-8B-FP8; DeepSeek-V3's; "FineGrainedFP8" in transformers): each linear layer's weight
W [N, K] is stored as e4m3 values `weight` [N, K] and one fp32 factor per 128 x 128 block, `weight_scale_inv`
[ceil(N / 128), ceil(K / 128)]:

    W[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]

A fused projection (q/k/v, gate/up: model.FUSED) keeps each part's blocks, so its rows carry `row_block`, the
factor row each weight row uses. Fp8Linear multiplies by W two ways, both next to their reference (linear_ref):
  - a few rows (decode at small batches), weight-only: the kernel reads the e4m3 bytes and their factors and
    multiplies in the activations' dtype (_weight_only_kernel); a step then reads half the bytes of bf16;
  - many rows: the activations are quantized too, per token and 128 columns (the format's "dynamic"
    activations), and multiplied on the FP8 tensor cores (_fp8_kernel).
The CPU runs the reference (the weight dequantized in the activations' dtype).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import kernel
from kernel import CAN_LAUNCH, FP8, FP8_MAX, tl, triton

BLOCK = 128  # the format's weight_block_size, both ways
WEIGHT_ONLY_ROWS = 64  # up to this many rows the weight-only kernel runs, above it the FP8 tensor cores
QUANTIZED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # every layer's linears; embedding, norms and
# lm_head stay as the checkpoint stores them


# ---- the format ------------------------------------------------------------------------------------------
def quantize_blocks(w: Tensor) -> tuple[Tensor, Tensor]:
    """W [N, K] -> (e4m3 [N, K], fp32 factors [ceil(N/128), ceil(K/128)]): each block's largest |value| maps to
    e4m3's largest, 448 (an all-zero block gets the factor 1)."""
    N, K = w.shape
    NB, KB = -(-N // BLOCK), -(-K // BLOCK)
    blocks = F.pad(w.float(), (0, KB * BLOCK - K, 0, NB * BLOCK - N)).view(NB, BLOCK, KB, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [NB, KB]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (blocks / scale[:, None, :, None]).to(FP8).view(NB * BLOCK, KB * BLOCK)
    return values[:N, :K].contiguous(), scale


def dequantize_blocks(weight: Tensor, scale_inv: Tensor, row_block: Tensor) -> Tensor:
    """The weight's values, fp32 [N, K]: weight [N, K] e4m3 times its block's factor (row_block [N]: each row's
    row of scale_inv [NB, KB])."""
    column_block = torch.arange(weight.shape[1], device=weight.device) // BLOCK
    return weight.float() * scale_inv[row_block][:, column_block]


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Activations x [M, K] -> (e4m3 [M, K rounded up to 128], fp32 factors [M, ceil(K/128)]): per token and 128
    columns, as the format's "dynamic" activations are."""
    M, K = x.shape
    KB = -(-K // BLOCK)
    groups = F.pad(x.float(), (0, KB * BLOCK - K)).view(M, KB, BLOCK)
    scale = groups.abs().amax(-1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (groups / scale[..., None]).to(FP8).view(M, KB * BLOCK), scale


def linear_ref(x: Tensor, weight: Tensor, scale_inv: Tensor, row_block: Tensor, quantized_x: bool = False) -> Tensor:
    """x [M, K] times W^T, W dequantized from its blocks: [M, N] in x's dtype. quantized_x: x quantized per token
    and 128 columns first (what the FP8 tensor-core kernel multiplies); else as it is (the weight-only kernel)."""
    if quantized_x:
        values, scale = quantize_rows(x)
        x_used = (values.float().view(*scale.shape, BLOCK) * scale[..., None]).view(x.shape[0], -1)[:, :x.shape[1]]
        return (x_used @ dequantize_blocks(weight, scale_inv, row_block).T).to(x.dtype)
    return F.linear(x, dequantize_blocks(weight, scale_inv, row_block).to(x.dtype))


def row_blocks(sizes: list[int], device=None) -> Tensor:
    """The factor row of each weight row of a projection fused from parts of these sizes, each part with its own
    blocks (a part of 192 rows has two block rows, the second half full)."""
    rows, first = [], 0
    for size in sizes:
        rows.append(torch.arange(size, device=device) // BLOCK + first)
        first += -(-size // BLOCK)
    return torch.cat(rows)


FORMAT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK], "activation_scheme": "dynamic"}
SUPPORTED = ("tinyflow loads 16-bit checkpoints and FP8 block ones (quantization_config quant_method fp8, fmt e4m3, "
             "weight_block_size [128, 128], activation_scheme dynamic: Qwen/Qwen3-8B-FP8's)")


def check_quantization_config(q):
    """config.json's quantization_config must be the FP8 block format (a key left out takes transformers' default,
    FORMAT's value); anything else is refused in one line naming what is supported."""
    if not isinstance(q, dict):
        raise ValueError(f"config.json: quantization_config must be an object; {SUPPORTED}")
    for key, value in FORMAT.items():
        if q.get(key, value) != value:  # JSON gives lists, so [128, 128] compares equal
            raise ValueError(f"config.json: quantization_config has {key} {q[key]!r}; {SUPPORTED}")


def check_split(cfg, tp):
    """Under tensor parallel each rank reads whole 128 x 128 blocks: its rows of q/k/v and gate/up and its columns
    of o_proj and down_proj must be multiples of 128 (cfg: the whole model's)."""
    parts = {"q_proj's rows and o_proj's columns": cfg.n_heads * cfg.head_dim,
             "k_proj's and v_proj's rows": cfg.n_kv_heads * cfg.head_dim, "the MLP's rows": cfg.intermediate_size}
    for what, n in parts.items():
        if tp.size > 1 and (n // tp.size) % BLOCK:
            raise ValueError(f"FP8 weights split over {tp.size} ranks: {what}, {n} in all, would be {n // tp.size} "
                             f"a rank, which cuts their 128 x 128 blocks; run with fewer ranks")


# ---- the linear layer --------------------------------------------------------------------------------------
class Fp8Linear(nn.Module):
    """nn.Linear's place with the weight in FP8 blocks: `weight` [N, K] e4m3, `weight_scale_inv` [NB, KB] fp32
    (the checkpoint's names), `row_block` [N] (fused parts: row_blocks), and the bias, if any, in the model's
    dtype."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool, dtype, device=None):
        super().__init__()
        N, KB = sum(sizes), -(-in_features // BLOCK)
        self.sizes = sizes  # the parts' rows (one part: a projection of its own)
        self.weight = nn.Parameter(torch.empty(N, in_features, dtype=FP8, device=device), requires_grad=False)
        NB = sum(-(-s // BLOCK) for s in sizes)
        self.weight_scale_inv = nn.Parameter(torch.empty(NB, KB, device=device), requires_grad=False)
        self.register_buffer("row_block", row_blocks(sizes, device), persistent=False)
        self.bias = nn.Parameter(torch.empty(N, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def of(cls, linear: nn.Linear, sizes: list[int] | None = None) -> "Fp8Linear":
        """A 16-bit linear layer quantized, each part of a fused one (sizes) in blocks of its own, as an FP8
        checkpoint stores them."""
        w = linear.weight
        sizes = sizes or [w.shape[0]]
        new = cls(w.shape[1], sizes, linear.bias is not None, w.dtype, w.device)
        parts = [quantize_blocks(part) for part in w.detach().split(sizes)]
        with torch.no_grad():
            new.weight.copy_(torch.cat([values for values, _ in parts]))
            new.weight_scale_inv.copy_(torch.cat([scale for _, scale in parts]))
            if linear.bias is not None:
                new.bias.copy_(linear.bias)
        return new

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        if x.is_cuda:
            y = torch.ops.tinyflow.fp8_linear(flat, self.weight, self.weight_scale_inv, self.row_block)
        else:
            y = linear_ref(flat, self.weight, self.weight_scale_inv, self.row_block)
        y = y if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], -1)


def place(model, device):
    """Each Fp8Linear's row_block computed on device (a model made on the meta device has none: to_empty leaves
    computed buffers uninitialised)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.row_block = row_blocks(module.sizes, device)


def convert(model, quantize: bool):
    """Every layer's linears (QUANTIZED) as Fp8Linear: quantized from their 16-bit weights (quantize), or empty,
    for an FP8 checkpoint to fill. One layer at a time, so a model quantized at load needs little more memory
    than its 16-bit weights."""
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if name not in QUANTIZED:
                    continue
                sizes = parent.sizes if name in ("qkv_proj", "gate_up_proj") else [child.weight.shape[0]]
                if quantize:
                    setattr(parent, name, Fp8Linear.of(child, sizes))
                else:
                    setattr(parent, name, Fp8Linear(child.weight.shape[1], sizes, child.bias is not None,
                                                    child.weight.dtype, child.weight.device))
    return model


# ---- the Triton kernels ------------------------------------------------------------------------------------
@triton.jit
def _weight_only_kernel(x, w, s, row_block, out, M, N, K, KB_PER, stride_xm, stride_wn, stride_sn,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr):
    """x [M, K] times W^T over this program's K blocks, program (n block, split, m block): into out [M, N] in its
    dtype, or with SPLIT the fp32 partial sums into out [split, M, N]."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m, c = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, 128)
    split = tl.program_id(1)
    scale_row = tl.load(row_block + n, mask=n < N, other=0)  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(split * KB_PER, tl.minimum((split + 1) * KB_PER, tl.cdiv(K, 128))):
        k = kb * 128 + c
        xs = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        ws = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        # e4m3 -> the activations' dtype is exact; the block's factor multiplies the block's partial sums
        if IEEE:  # fp32 activations (the tests'): fp32 products, not TF32's
            part = tl.dot(xs, tl.trans(ws.to(xs.dtype)), input_precision="ieee")
        else:
            part = tl.dot(xs, tl.trans(ws.to(xs.dtype)))
        acc += part * tl.load(s + scale_row * stride_sn + kb, mask=n < N, other=0.0)[None, :]
    mask = (m[:, None] < M) & (n[None, :] < N)
    if SPLIT:
        tl.store(out + split * M * N + m[:, None] * N + n[None, :], acc, mask=mask)
    else:
        tl.store(out + m[:, None] * N + n[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_kernel(a, a_scale, w, s, row_block, out, M, N, K, stride_am, stride_wn, stride_sn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """out [M, N] = dequantized a [M, K'] times dequantized W^T: e4m3 x e4m3 products on the tensor cores, each 128
    columns' partial sums times the token's and the block's factors."""
    pid, n_m, n_n = tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group_first = pid // (GROUP * n_n) * GROUP  # GROUP row blocks share the weight blocks they read (L2)
    rows_in_group = tl.minimum(n_m - group_first, GROUP)
    pid_m = group_first + pid % (GROUP * n_n) % rows_in_group
    pid_n = pid % (GROUP * n_n) // rows_in_group
    m, n = pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.arange(0, 128)
    KB = tl.cdiv(K, 128)
    scale_row = tl.load(row_block + n, mask=n < N, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(KB):
        k = kb * 128 + c
        xs = tl.load(a + m[:, None] * stride_am + k[None, :], mask=m[:, None] < M, other=0.0)
        ws = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        factors = tl.load(a_scale + m * KB + kb, mask=m < M, other=0.0)[:, None] * \
            tl.load(s + scale_row * stride_sn + kb, mask=n < N, other=0.0)[None, :]
        acc += tl.dot(xs, tl.trans(ws)) * factors
    tl.store(out + m[:, None] * N + n[None, :], acc.to(out.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))


# The weight-only kernel's launch: rows of W per program, the waves of SMs that splitting K aims for (0: never
# split), warps, pipeline stages. tests/gpu_fp8_linear.py times others (docs/performance.md, "FP8 weights").
WEIGHT_ONLY_LAUNCH = dict(block_n=64, waves=2, num_warps=4, num_stages=4)


def _weight_only(x, weight, scale_inv, row_block, block_n, waves, num_warps, num_stages):
    M, K = x.shape
    N, KB = weight.shape[0], -(-K // BLOCK)
    n_blocks, m_blocks = triton.cdiv(N, block_n), triton.cdiv(M, 64)
    kb_per = triton.cdiv(KB, max(1, min(KB, triton.cdiv(waves * kernel._sm_count(x.device), n_blocks))))
    splits = triton.cdiv(KB, kb_per)  # split K until the grid covers `waves` waves of SMs
    out = torch.empty(splits, M, N, device=x.device, dtype=torch.float32) if splits > 1 else \
        torch.empty(M, N, device=x.device, dtype=x.dtype)
    torch.library.wrap_triton(_weight_only_kernel)[(n_blocks, splits, m_blocks)](
        x, weight, scale_inv, row_block, out, M, N, K, kb_per, x.stride(0), weight.stride(0), scale_inv.stride(0),
        BLOCK_M=max(16, min(64, triton.next_power_of_2(M))), BLOCK_N=block_n, IEEE=x.dtype == torch.float32,
        SPLIT=splits > 1, num_warps=num_warps, num_stages=num_stages)
    return out.sum(0).to(x.dtype) if splits > 1 else out  # the splits summed in a fixed order: the same every run


TENSOR_CORE_ROWS = 4096  # rows quantized and multiplied at a time: a long prefill's fp32 copies of its activations
# stay bounded (quantize_rows), and so do the kernel's int32 offsets


def _tensor_cores(x, weight, scale_inv, row_block):
    if x.shape[0] > TENSOR_CORE_ROWS:
        return torch.cat([_tensor_cores(part, weight, scale_inv, row_block) for part in x.split(TENSOR_CORE_ROWS)])
    M, N = x.shape[0], weight.shape[0]
    values, scale = quantize_rows(x)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    BLOCK_M, BLOCK_N = (64 if M <= 128 else 128), 128
    grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
    torch.library.wrap_triton(_fp8_kernel)[grid](
        values, scale, weight, scale_inv, row_block, out, M, N, x.shape[1], values.stride(0), weight.stride(0),
        scale_inv.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, GROUP=8, num_warps=8 if BLOCK_M == 128 else 4,
        num_stages=3)
    return out


def _as_torch_op(fn):
    """fn as the op tinyflow::fp8_linear, opaque to torch.compile (which kernel runs, and its grid, depend on the
    number of rows, which the compiled step leaves dynamic); only where the kernels can launch (kernel.py's
    _as_torch_op says why)."""
    if not CAN_LAUNCH:
        return fn
    op = torch.library.custom_op("tinyflow::fp8_linear", mutates_args=())(fn)
    op.register_fake(lambda x, weight, scale_inv, row_block: x.new_empty(x.shape[0], weight.shape[0]))
    return op


@_as_torch_op
def _fp8_linear_op(x: Tensor, weight: Tensor, scale_inv: Tensor, row_block: Tensor) -> Tensor:
    if x.shape[0] <= WEIGHT_ONLY_ROWS:
        return _weight_only(x.contiguous(), weight, scale_inv, row_block, **WEIGHT_ONLY_LAUNCH)
    return _tensor_cores(x, weight, scale_inv, row_block)


def fp8_linear(x, weight, scale_inv, row_block, weight_only: bool | None = None, **launch) -> Tensor:
    """Triton version of linear_ref: x [M, K] times W^T, [M, N] in x's dtype. weight_only: which kernel (default:
    the weight-only one up to WEIGHT_ONLY_ROWS rows); the tensor cores' result is linear_ref(quantized_x=True)'s.
    launch: the weight-only kernel's settings other than WEIGHT_ONLY_LAUNCH's (tests/gpu_fp8_linear.py)."""
    if not CAN_LAUNCH:
        raise RuntimeError("the Triton kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1 set before kernel "
                           "is imported; on this machine call fp8.linear_ref (same arguments)")
    if weight_only is None:
        return torch.ops.tinyflow.fp8_linear(x, weight, scale_inv, row_block)
    if weight_only:
        return _weight_only(x.contiguous(), weight, scale_inv, row_block, **{**WEIGHT_ONLY_LAUNCH, **launch})
    return _tensor_cores(x, weight, scale_inv, row_block)
