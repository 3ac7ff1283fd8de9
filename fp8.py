"""FP8 weights: the block format of Qwen's FP8 checkpoints, quantizing a 16-bit checkpoint into it at load, and
the linear layer that multiplies by it without writing the weight out in 16 bits.

The format (Qwen/Qwen3-8B-FP8; DeepSeek-V3's; "FineGrainedFP8" in transformers): each linear layer's weight
W [N, K] is stored as e4m3 values `weight` [N, K] and one fp32 factor per 128 x 128 block, `weight_scale_inv`
[ceil(N / 128), ceil(K / 128)]:

    W[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128]

A fused projection (q/k/v, gate/up: model.FUSED) keeps each part's blocks, so its rows carry `row_block`, the
factor row each weight row uses. Fp8Linear multiplies by W two ways, both next to their reference (linear_ref):
  - one row (decode at batch 1: WEIGHT_ONLY_ROWS), weight-only: the kernel reads the e4m3 bytes and their factors
    and multiplies in fp32 (_weight_only_kernel); a step then reads half the bytes of bf16;
  - more rows: the activations are quantized too, per token and 128 columns (the format's "dynamic"
    activations: _quantize_kernel), and multiplied on the FP8 tensor cores: by cuBLAS (torch._scaled_mm's
    blockwise factors) where the layer's blocks are whole, else by _fp8_kernel.
The CPU runs the reference of the kernel the GPU would pick (linear_ref, quantized_x above WEIGHT_ONLY_ROWS rows).
"""
import functools
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import kernel
from kernel import CAN_LAUNCH, FP8, FP8_MAX, tl, triton

BLOCK = 128  # the format's weight_block_size, both ways
QUANTIZED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # every layer's linears; the embedding and the
# norms stay as the checkpoint stores them, the LM head too unless asked (quantize_head), as Qwen's FP8 checkpoints


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
    # times 1/448, not / 448: torch divides by a number as a product with its reciprocal on CUDA and not on the CPU;
    # a product is the same on both and in _quantize_kernel
    scale = groups.abs().amax(-1) * (1 / FP8_MAX)
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
    of o_proj and down_proj must be multiples of 128 (cfg: the whole model's). Then the activations' 128-column
    groups of o_proj and down_proj are one process's too."""
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
        return cls.of_weight(linear.weight, linear.bias, sizes)

    @classmethod
    def of_weight(cls, w: Tensor, bias: Tensor | None = None, sizes: list[int] | None = None) -> "Fp8Linear":
        """Fp8Linear.of for a weight [N, K] (and bias [N]) given as tensors."""
        sizes = sizes or [w.shape[0]]
        new = cls(w.shape[1], sizes, bias is not None, w.dtype, w.device)
        parts = [quantize_blocks(part) for part in w.detach().split(sizes)]
        with torch.no_grad():
            new.weight.copy_(torch.cat([values for values, _ in parts]))
            new.weight_scale_inv.copy_(torch.cat([scale for _, scale in parts]))
            if bias is not None:
                new.bias.copy_(bias)
        return new

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])  # [M, K]
        if x.is_cuda:
            y = torch.ops.tinyflow.fp8_linear(flat, self.weight, self.weight_scale_inv, self.row_block)
        else:  # the GPU's math: the activations quantized too where the tensor cores would multiply
            y = linear_ref(flat, self.weight, self.weight_scale_inv, self.row_block,
                           quantized_x=flat.shape[0] > WEIGHT_ONLY_ROWS)
        y = y if self.bias is None else y + self.bias
        return y.view(*x.shape[:-1], -1)


def place(model, device):
    """Each Fp8Linear's row_block computed on device (a model made on the meta device has none: to_empty leaves
    computed buffers uninitialised)."""
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.row_block = row_blocks(module.sizes, device)


def quantize(model, weights: str, stored_blocks: bool = False):
    """The model's weights as `weights` says (model.WEIGHTS): "fp8", the layers' linears quantized into FP8 blocks
    (unless the checkpoint stored them so: stored_blocks); "fp8-all", the LM head too; "auto", as they are. What is
    quantized already stays as it is (quantizing its e4m3 values again would lose their factors)."""
    if weights != "auto" and not stored_blocks:
        convert(model, quantize=True)
    if weights == "fp8-all" and weights_of(model) != "fp8-all":
        quantize_head(model)
    return model


def weights_of(model) -> str:
    """What quantize made of the model: "fp8-all", "fp8" or "auto" (its name in benchmarks' and runs' files)."""
    if not isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear):
        return "auto"
    return "fp8-all" if isinstance(getattr(model, "lm_head", None), Fp8Linear) else "fp8"


def quantize_head(model):
    """The LM head in FP8 blocks too (weights="fp8-all"): at one row it reads a byte a weight instead of two. A head
    tied to the embedding gets a quantized copy of the rows it uses; the embedding's lookup stays 16-bit."""
    w = model.model.embed_tokens.weight[model.vocab_part] if model.embedding_is_head else model.lm_head.weight  # [V, K]
    model.lm_head = Fp8Linear.of_weight(w)
    return model


def convert(model, quantize: bool):
    """Every layer's linears (QUANTIZED) as Fp8Linear: quantized from their 16-bit weights (quantize), or empty,
    for an FP8 checkpoint to fill. One layer at a time, so a model quantized at load needs little more memory
    than its 16-bit weights."""
    for block in model.model.layers:
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if name not in QUANTIZED or isinstance(child, Fp8Linear):  # quantized already: its blocks stay
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
def _weight_only_kernel(x, w, s, row_block, out, partials, arrived, M, N, K, KB_PER, n_splits, stride_xm, stride_wn,
                        stride_sn, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SPLIT: tl.constexpr):
    """One row of x [M, K] times W^T over this program's K blocks, program (row, n block, split), without tensor
    cores: the e4m3 weights widened to fp32 and multiplied-added in fp32 (for a tensor-core product they would go
    to 16 bits first, which costs more than the product at a few rows). GROUPS blocks of 128 columns a loop
    (KB_PER a multiple of it). The rows are the grid's fastest axis, so the programs of one weight tile run
    together and read it from L2 but once. Into out [M, N] in x's dtype (with SPLIT through _add_splits)."""
    row, split = tl.program_id(0).to(tl.int64), tl.program_id(2)  # int64: row * K past 2^31 at ~90k rows
    n, c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), tl.arange(0, 128)
    scale_row = tl.load(row_block + n, mask=n < N, other=0)  # [BLOCK_N]
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    KB = tl.cdiv(K, 128)
    for kb0 in range(split * KB_PER, tl.minimum((split + 1) * KB_PER, KB), GROUPS):
        kb = kb0 + tl.arange(0, GROUPS)  # [GROUPS]
        k = kb[:, None] * 128 + c[None, :]  # [GROUPS, 128]
        xs = tl.load(x + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        ws = tl.load(w + n[:, None, None] * stride_wn + k[None, :, :],
                     mask=(n[:, None, None] < N) & (k[None, :, :] < K), other=0.0)  # [BLOCK_N, GROUPS, 128]
        part = tl.sum(ws.to(tl.float32) * xs[None, :, :], axis=2)  # [BLOCK_N, GROUPS]
        factors = tl.load(s + scale_row[:, None] * stride_sn + kb[None, :],
                          mask=(n[:, None] < N) & (kb[None, :] < KB), other=0.0)  # each block's factor
        acc += tl.sum(part * factors, axis=1)
    if SPLIT:
        _add_splits(acc, partials, arrived, out, row * N + n, n < N, n_splits, M * N)
    else:
        tl.store(out + row * N + n, acc.to(out.dtype.element_ty), mask=n < N)


@triton.jit
def _add_splits(acc, partials, arrived, out, at, mask, n_splits, MN):
    """Split K without a kernel to add the splits (program (i, j, split)): each split stores its fp32 sums `acc`
    at offsets `at` of partials [n_splits, M, N], and the split that arrives last at its (i, j) (a count in
    arrived [grid i x grid j], zeros: _arrivals) adds them all, in split order (so the same sum every run,
    whichever split came last), into out [M, N], and sets the count back to zero for the next launch."""
    tl.store(partials + tl.program_id(2) * MN + at, acc, mask=mask)
    tl.debug_barrier()  # every thread's sums stored before the count goes up (the atomic releases them)
    count = arrived + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(count, 1, sem="acq_rel") == n_splits - 1:
        total = tl.zeros_like(acc)
        for i in range(n_splits):  # .cg: from L2, where the other programs' sums are
            total += tl.load(partials + i * MN + at, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out + at, total.to(out.dtype.element_ty), mask=mask)
        tl.store(count, 0)  # no other program of this launch counts here any more


@triton.jit
def _quantize_kernel(x, values, scales, M, M_PAD, K, stride_xm, BLOCK_M: tl.constexpr):
    """quantize_rows on the GPU, one launch: x [M, K] -> values [M_PAD, KB * 128] e4m3 (the last block's padding
    and rows M.. 0), scales [KB, M_PAD] (quantize_rows' transposed: the layout cuBLAS reads; rows M.. 1); program
    (m block, k block)."""
    m, kb = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M), tl.program_id(1)
    k, KB = kb * 128 + tl.arange(0, 128), tl.num_programs(1)
    xs = tl.load(x + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
    # [BLOCK_M]: the largest |value| to e4m3's largest (times 1/448, as quantize_rows); div_rn below: IEEE division,
    # as torch's (Triton's `/` may be off by an ulp on a GPU)
    scale = tl.max(tl.abs(xs.to(tl.float32)), axis=1) * 0.002232142857142857
    scale = tl.where(scale > 0, scale, 1.0)
    xq = tl.math.div_rn(xs.to(tl.float32), scale[:, None]).to(tl.float8e4nv)
    tl.store(values + m[:, None] * KB * 128 + k[None, :], xq, mask=m[:, None] < M_PAD)
    tl.store(scales + kb * M_PAD + m, scale, mask=m < M_PAD)


@triton.jit
def _fp8_kernel(a, a_scales, w, s, row_block, out, partials, arrived, M, N, K, KB_PER, n_splits, stride_am,
                stride_wn, stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    """a [M, KB * 128] e4m3 and a_scales [KB, M] (x quantized by _quantize_kernel) times W^T over this program's K
    blocks, program (m block, n block, split), on the FP8 tensor cores: each block's partial sums times the
    token's and the block's factors. Into out [M, N] in x's dtype (with SPLIT through _add_splits)."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split, c, KB = tl.program_id(2), tl.arange(0, 128), tl.cdiv(K, 128)
    scale_row = tl.load(row_block + n, mask=n < N, other=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(split * KB_PER, tl.minimum((split + 1) * KB_PER, KB)):
        k = kb * 128 + c
        xs = tl.load(a + m[:, None] * stride_am + k[None, :], mask=m[:, None] < M, other=0.0)
        ws = tl.load(w + n[:, None] * stride_wn + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0)
        factors = tl.load(a_scales + kb * M + m, mask=m < M, other=0.0)[:, None] * \
            tl.load(s + scale_row * stride_sn + kb, mask=n < N, other=0.0)[None, :]
        acc += tl.dot(xs, tl.trans(ws)) * factors
    at, mask = m[:, None] * N + n[None, :], (m[:, None] < M) & (n[None, :] < N)
    if SPLIT:
        _add_splits(acc, partials, arrived, out, at, mask, n_splits, M * N)
    else:
        tl.store(out + at, acc.to(out.dtype.element_ty), mask=mask)


# Launch settings, chosen on an H200 by tests/gpu_fp8_linear.py (docs/performance.md, "FP8 weights"): the most
# rows of x (tensor cores) and the rows of W per program, the 128-column blocks a loop (weight-only), the waves of
# SMs that splitting K aims for (0: never split), warps, pipeline stages. Up to WEIGHT_ONLY_ROWS rows the
# weight-only kernel runs; above them the activations are quantized and multiplied on the tensor cores, by cuBLAS
# from CUBLAS_ROWS rows where the weights' blocks allow (_cublas_reads), else by _fp8_kernel. WEIGHT_ONLY_ROWS
# stays 1 while the CPU picks its reference in Python (Fp8Linear.forward): the compiled step's batch is dynamic
# from 2 rows, and a test at 2 or 4 would put a guard on it.
WEIGHT_ONLY_LAUNCH = dict(block_n=32, groups=2, waves=4, num_warps=8, num_stages=3)
TENSOR_CORE_LAUNCH = dict(block_m=64, block_n=64, waves=2, num_warps=4, num_stages=4)
WEIGHT_ONLY_ROWS = 1
CUBLAS_ROWS = 64
MOST_WAVES = 8  # the most a launch's `waves` may be


def _splits(programs: int, KB: int, waves: int, device, multiple: int = 1) -> tuple[int, int]:
    """(K blocks per split, splits): K split until the grid covers `waves` waves of SMs; a split's blocks a
    multiple of `multiple`."""
    if waves > MOST_WAVES:
        raise ValueError(f"a launch aims for at most {MOST_WAVES} waves of SMs (the counts _arrivals keeps), "
                         f"not {waves}")
    kb_per = triton.cdiv(KB, max(1, min(KB, triton.cdiv(waves * kernel._sm_count(device), max(1, programs)))))
    kb_per = triton.cdiv(kb_per, multiple) * multiple
    return kb_per, triton.cdiv(KB, kb_per)


def _outputs(x, N, grid: tuple[int, int, int]):
    """Where a kernel on this grid (i, j, split) writes: out [M, N] in x's dtype and, when K is split, the splits'
    fp32 sums [splits, M, N] and a zero count per (i, j) (_add_splits)."""
    M, split = x.shape[0], grid[2] > 1
    return (torch.empty(M, N, device=x.device, dtype=x.dtype),
            torch.empty(grid[2] if split else 0, M, N, device=x.device, dtype=torch.float32),
            _arrivals(x.device)[:grid[0] * grid[1] if split else 0])


@functools.cache
def _arrivals(device) -> Tensor:
    """The split kernels' arrival counts, one a program (i, j), left zero by every launch (_add_splits): no memset
    a call (at one row the step had three a layer). A grid splits K only while it has fewer programs
    than `waves` x SMs (_splits), so that many serve every launch. Launches that share them must not overlap:
    tinyflow runs a device's kernels on one stream at a time (warm-ups, captures and replays in turn). Made outside
    a CUDA graph's capture (each step size is warmed up first): inside one they would be the graph's memory."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fp8: run an FP8 product once before capturing a CUDA graph of it (its split counts are "
                           "made on the first run)")
    return torch.zeros(MOST_WAVES * kernel._sm_count(device), dtype=torch.int32, device=device)


def _weight_only(x, weight, scale_inv, row_block, block_n, groups, waves, num_warps, num_stages):
    M, K = x.shape
    N, KB = weight.shape[0], -(-K // BLOCK)
    n_blocks = triton.cdiv(N, block_n)
    kb_per, splits = _splits(M * n_blocks, KB, waves, x.device, groups)
    grid = (M, n_blocks, splits)
    out, partials, arrived = _outputs(x, N, grid)
    torch.library.wrap_triton(_weight_only_kernel)[grid](
        x, weight, scale_inv, row_block, out, partials, arrived, M, N, K, kb_per, splits, x.stride(0),
        weight.stride(0), scale_inv.stride(0), BLOCK_N=block_n, GROUPS=groups, SPLIT=splits > 1,
        num_warps=num_warps, num_stages=num_stages)
    return out


def _quantized(x, rows_multiple: int = 1):
    """x [M, K] quantized per token and 128 columns by _quantize_kernel: (e4m3 [M', KB * 128], fp32 [KB, M']),
    M' = M rounded up to rows_multiple (rows of zeros)."""
    M, K = x.shape
    KB, M_pad = -(-K // BLOCK), -(-M // rows_multiple) * rows_multiple
    a = torch.empty(M_pad, KB * BLOCK, device=x.device, dtype=FP8)
    a_scales = torch.empty(KB, M_pad, device=x.device, dtype=torch.float32)
    block_m = min(8, triton.next_power_of_2(M_pad))  # no more rows than there are (a block of 64, nearly all
    # masked, was slower at a few rows); 8 a program, the fastest at 507 rows (docs/performance.md, "The FP8 kernel's
    # selection, taken apart")
    torch.library.wrap_triton(_quantize_kernel)[(triton.cdiv(M_pad, block_m), KB)](x, a, a_scales, M, M_pad, K,
                                                                                   x.stride(0), BLOCK_M=block_m)
    return a, a_scales


def _tensor_cores(x, weight, scale_inv, row_block, block_m, block_n, waves, num_warps, num_stages):
    M, K = x.shape
    N, KB = weight.shape[0], -(-K // BLOCK)
    a, a_scales = _quantized(x)
    block_m = max(16, min(block_m, triton.next_power_of_2(M)))  # block_m: the most rows a program takes
    m_blocks, n_blocks = triton.cdiv(M, block_m), triton.cdiv(N, block_n)
    kb_per, splits = _splits(m_blocks * n_blocks, KB, waves, x.device)
    grid = (m_blocks, n_blocks, splits)
    out, partials, arrived = _outputs(x, N, grid)
    torch.library.wrap_triton(_fp8_kernel)[grid](
        a, a_scales, weight, scale_inv, row_block, out, partials, arrived, M, N, K, kb_per, splits, a.stride(0),
        weight.stride(0), scale_inv.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=splits > 1,
        num_warps=num_warps, num_stages=num_stages)
    return out


def _cublas_reads(x, weight, scale_inv) -> bool:
    """Whether torch._scaled_mm's blockwise product (cuBLAS; factors per token and 128 columns of x, per 128 x 128
    block of W) takes this layer: where this torch and GPU have it (_cublas_blockwise), K a multiple of 128 and
    its blocks of 4 (the factors' padding), and no fused part ending in half a block (row_block would be
    n // 128)."""
    N, K = weight.shape
    return (x.is_cuda and K % (4 * BLOCK) == 0 and scale_inv.shape[0] * BLOCK == N
            and _cublas_blockwise(x.device, x.dtype))


@functools.cache
def _cublas_blockwise(device, dtype) -> bool:
    """A Hopper GPU (cuBLAS has the blockwise product for sm_90) whose torch runs it into `dtype`: cuBLAS 12.9
    and a torch that passes the factors on (mid-2025) are needed, so one small product is tried, once. It runs
    uncaptured: each step size's warm-up runs before its capture, and prefill is never captured. Where it fails, the
    Triton kernel multiplies, and a warning says so."""
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    x = torch.ones(16, 4 * BLOCK, device=device, dtype=dtype)
    try:
        _cublas(x, torch.ones(BLOCK, 4 * BLOCK, device=device).to(FP8), torch.ones(1, 4, device=device))
        return True
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, ValueError) as e:  # refused before any launch: the argument checks, cuBLAS's heuristics
        warnings.warn(f"FP8 weights: cuBLAS's blockwise product does not run here ({str(e).splitlines()[0]}); "
                      f"the Triton kernel multiplies at every batch size (slower from 128 rows)")
        return False


def _cublas(x, weight, scale_inv):
    a, a_scales = _quantized(x, rows_multiple=16)  # [M', K], [KB, M']: cuBLAS refuses 1 row (seen on an H200)
    return torch._scaled_mm(a, weight.t(), a_scales.t(), scale_inv.t(), out_dtype=x.dtype)[:x.shape[0]]


MAX_ROWS = 4096  # rows quantized and multiplied at a time: the kernels' int32 offsets stay in range


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
    """The kernel for this many rows (the launch settings' comment above)."""
    x = x.contiguous()
    if weight.shape[0] == 0:  # a tensor-parallel rank with no rows of a small vocabulary's LM head
        return x.new_empty(x.shape[0], 0)
    if x.shape[0] <= WEIGHT_ONLY_ROWS:
        return _weight_only(x, weight, scale_inv, row_block, **WEIGHT_ONLY_LAUNCH)
    if x.shape[0] > MAX_ROWS:
        return torch.cat([_quantized_product(part, weight, scale_inv, row_block) for part in x.split(MAX_ROWS)])
    return _quantized_product(x, weight, scale_inv, row_block)


def _quantized_product(x, weight, scale_inv, row_block):
    """x quantized and multiplied on the tensor cores: by cuBLAS from CUBLAS_ROWS rows where it reads the layer,
    else by Triton (each part of a long x, however few its rows: the same math either way)."""
    if x.shape[0] >= CUBLAS_ROWS and _cublas_reads(x, weight, scale_inv):
        return _cublas(x, weight, scale_inv)
    return _tensor_cores(x, weight, scale_inv, row_block, **TENSOR_CORE_LAUNCH)


def fp8_linear(x, weight, scale_inv, row_block, kernel: str | None = None, **launch) -> Tensor:
    """Triton or cuBLAS version of linear_ref: x [M, K] times W^T, [M, N] in x's dtype. kernel: "weight_only",
    "tensor_cores" or "cublas" (default: the one for this many rows); the last two give linear_ref(quantized_x=True).
    launch: the kernel's settings other than its *_LAUNCH's (tests/gpu_fp8_linear.py)."""
    if not CAN_LAUNCH:
        raise RuntimeError("the Triton kernels run on CUDA, or on the CPU with TRITON_INTERPRET=1 set before kernel "
                           "is imported; on this machine call fp8.linear_ref (same arguments)")
    if kernel is None:
        return torch.ops.tinyflow.fp8_linear(x, weight, scale_inv, row_block)
    if kernel == "cublas":
        return _cublas(x.contiguous(), weight, scale_inv)
    fn, default = {"weight_only": (_weight_only, WEIGHT_ONLY_LAUNCH),
                   "tensor_cores": (_tensor_cores, TENSOR_CORE_LAUNCH)}[kernel]
    return fn(x.contiguous(), weight, scale_inv, row_block, **{**default, **launch})
