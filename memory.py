"""What fits in GPU memory: the bytes one more sequence costs (its KV slots and its share of the decode
step's buffers) and prefill's transient needs, from which the batch size is picked or checked before
anything is allocated."""
import os

import torch

import kernel
from cache import KVCache
from model import MLP_TOKENS, plural

PREFILL_TOKENS = 16384  # prompts are prefilled in groups of about this many (padded) tokens
SPARE = 2**30  # for the compiler's and cuBLAS's workspaces, the graph pool, fragmentation


def bytes_per_row(cfg, slots: int, dtype, extra: int = 0, kv_dtype=None) -> int:
    """GPU memory one more sequence costs: its KV slots (stored in kv_dtype, default dtype), its share of the
    decode step's buffers and `extra` bytes. The step's share: 48 bytes per vocabulary id, measured
    (docs/performance.md, "A server under load, and the memory planner"): the sampler's logits, probabilities,
    noise and sort buffers (fp32/int64, 40 bytes), the ids its repetition penalty has seen (1 byte), the step's
    temporaries in its graphs' pool (the rest); with FP8, also one layer's keys as values, which the rules that
    read keys (keydiff, rkv, knorm) dequantize each step."""
    keys = slots * cfg.n_kv_heads * cfg.head_dim * dtype.itemsize if kv_dtype == kernel.FP8 else 0
    return KVCache.bytes_needed(cfg, 1, slots, dtype, kv_dtype=kv_dtype) + keys + 48 * cfg.vocab_size + extra


def prefill_bytes(cfg, tokens: int, dtype) -> int:
    """Transient memory of prefilling `tokens` (padded) prompt tokens: activations, one layer's K/V expanded
    to every query head, the SnapKV window's attention (fp32), the MLP of one chunk of tokens, and the
    fp32 scores of H2O / VATP's column sums (policies.attention_column_sums, within its budget)."""
    per_token = 4 * cfg.hidden_size + 6 * cfg.n_heads * cfg.head_dim
    mlp = min(tokens, MLP_TOKENS) * 3 * cfg.intermediate_size * dtype.itemsize
    return tokens * (per_token * dtype.itemsize + 4 * 32 * cfg.n_heads) + mlp + 2**28


def batch_that_fits(cfg, slots: int, longest_prompt: int, free: int, dtype, extra: int = 0, kv_dtype=None) -> int:
    """The most sequences whose cache and decode buffers fit in `free` bytes, after prefill's needs."""
    fixed = prefill_bytes(cfg, max(PREFILL_TOKENS, longest_prompt), dtype) + SPARE
    return max(0, (free - fixed) // bytes_per_row(cfg, slots, dtype, extra, kv_dtype))


def device_free_bytes(device) -> int:
    """Free GPU memory as PyTorch can use it: the device's, and what its caching allocator holds for no tensor
    (a benchmark's probe copies, the last cache's step buffers), which it gives back to a new allocation that
    needs it, but for the free pieces of blocks that still hold a tensor (it can give those back to nothing
    larger); the device's own count leaves that memory out (docs/performance.md, "A server under load, and the
    memory planner")."""
    held_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    pieces = torch.cuda.memory_stats(device).get("inactive_split_bytes.all.current", 0)
    return torch.cuda.mem_get_info(device)[0] + held_free - pieces


def allocated(device) -> int:
    """Bytes PyTorch's tensors hold on a CUDA device (0 elsewhere)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def free_bytes(engine) -> int:
    """Free GPU memory, counting what the engine's current shape holds (its cache, buffers and what its captured
    steps keep: engine.held_bytes, measured when they were made), which is given back, or kept for the same
    shape, before a new cache is made: counting its cache alone would refuse the same batch asked again."""
    return device_free_bytes(engine.device) + (engine.held_bytes if engine.cache is not None else 0)


def pick_batch(engine, asked: int | None, n_prompts: int, slots: int, longest: int, extra: int = 0) -> int:
    """Check an asked batch size against free memory (before allocating), or pick one (asked None: as many
    as fit, at most n_prompts). extra: bytes per row beyond the cache and the decode step's buffers."""
    cfg, dtype, kv_dtype = engine.model.cfg, engine.dtype, engine.kv_dtype
    batch = min(asked or n_prompts, n_prompts)
    if engine.device.type != "cuda":  # only a check that the cache can exist in this machine's memory
        need = KVCache.bytes_needed(cfg, batch, slots, dtype, kv_dtype=kv_dtype)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > ram:
            raise ValueError(f"{rows_need(batch, slots)} {need / 2**30:.1f} GiB, more than this machine's "
                             f"{ram / 2**30:.1f} GiB; lower the batch size ({batch}), --max-new-tokens or --budget")
        return batch
    free = free_bytes(engine)
    # tensor parallel: the rows every rank can hold (cfg is this rank's part of the model)
    fits = engine.model.tp.smallest(batch_that_fits(cfg, slots, longest, free, dtype, extra, kv_dtype))
    if asked is None and fits > 0:
        return min(batch, fits)
    if batch > fits:
        need = (batch * bytes_per_row(cfg, slots, dtype, extra, kv_dtype) + SPARE
                + prefill_bytes(cfg, max(PREFILL_TOKENS, longest), dtype))
        raise ValueError(f"{rows_need(batch, slots)} {need / 2**30:.2f} GiB of GPU memory but {free / 2**30:.2f} "
                         f"GiB is free ({fits} would fit); lower the batch size, --max-new-tokens or --budget")
    return batch


def rows_need(batch: int, slots: int) -> str:
    """"3 sequences of 64 KV slots need", "1 sequence of 1 KV slot needs": how a refusal of their memory begins."""
    return f"{plural(batch, 'sequence')} of {plural(slots, 'KV slot')} need" + ("s" if batch == 1 else "")
