"""Sampling without host syncs: per-row temperature, top-k, top-p and repetition penalty as values in
device buffers (a Sampler), so that one compiled decode step serves every mix of settings, and noise that
depends only on (seed, position, token id), so that a sample never depends on the batch it ran in."""
import math
import numbers
import random
from dataclasses import dataclass
from typing import ClassVar

import torch

from policies import hash32, is_int


def uniform_noise(seeds, positions, vocab: int):
    """Uniform (0, 1) noise [B, vocab] that depends only on (seed, position, token id): the same prompt
    and seed give the same sample in any batch, on any device, with no generator state to capture."""
    # the seed's high 32 bits folded in (hash32(0) = 0: seeds 0 to 2^32 - 1 draw what they always drew)
    row = hash32((seeds * 0x9E3779B1 + positions) ^ hash32(seeds >> 32))  # [B]
    x = hash32(row[:, None] * 0x85EBCA77 + torch.arange(vocab, device=seeds.device))  # [B, V]
    return ((x >> 8).float() + 0.5) / 2**24  # top 24 bits: exact in fp32, never 0 or 1


def apply_penalty(logits, seen, penalty):
    """transformers' repetition_penalty: the logit of every token id already in the prompt or the output is
    divided by the penalty when positive, multiplied by it when negative. logits: [B, V] fp32; seen: [B, V]
    bool; penalty: [B] (1: none)."""
    p = penalty[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def sample(logits, seeds, positions, temperature, top_k, top_p):
    """One token per row from logits [B, V] fp32, each row with its own settings: temperature [B] fp32 (0:
    greedy, the argmax exactly), top_k [B] int64 (0: no limit), top_p [B] fp32. positions: [B], the
    positions of the tokens being sampled. Returns [B]. Settings are values, not branches, so one compiled
    step serves every mix of them (at the price of one sort of the vocabulary per row and step)."""
    V = logits.shape[-1]
    hot = temperature > 0
    scaled = logits / torch.where(hot, temperature, 1.0)[:, None]  # [B, V]
    ordered = scaled.sort(-1, descending=True).values  # [B, V]
    # top-k: the tokens below the k-th largest logit go (ties with it stay, as in transformers)
    k = torch.where(top_k > 0, top_k.clamp(max=V), V)[:, None]  # [B, 1]
    kept = ordered >= ordered.gather(1, k - 1)  # [B, V], in sorted order
    # top-p: a token goes once the more likely tokens before it already cover top_p
    probs = ordered.masked_fill(~kept, float("-inf")).softmax(-1)
    kept &= (probs.cumsum(-1) - probs < top_p[:, None]) | (top_p[:, None] >= 1)  # fp32 sums reach 1 early
    kept[:, 0] = True  # the most likely token always stays (a top_p that rounds to 0 in fp32 would keep none)
    # both cut the sorted row: what stays is every logit down to the last kept one (ties with it too)
    lowest = ordered.gather(1, kept.sum(-1, keepdim=True) - 1)  # [B, 1]
    probs = scaled.masked_fill(scaled < lowest, float("-inf")).softmax(-1)
    # argmax(p / E) with E ~ Exponential(1) is a draw from p (the exponential-race trick)
    drawn = (probs / -uniform_noise(seeds, positions, V).log()).argmax(-1)
    return torch.where(hot, drawn, logits.argmax(-1))


# The decode step calls sample() as one opaque operator: its PyTorch kernels run as they are, inside the
# CUDA graph like the rest of the step, instead of being fused by the compiler, whose code generation
# (torch 2.11's inductor) fails on this function at batch 64 and above (InductorError in get_block_shape).
@torch.library.custom_op("tinyflow::sample", mutates_args=())
def sample_op(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
              top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    return sample(logits, seeds, positions, temperature, top_k, top_p)


@sample_op.register_fake
def _(logits, seeds, positions, temperature, top_k, top_p):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings (the decode step reads them per row from a Sampler)."""
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # 1: none

    def __post_init__(self):
        check_sampling(self)

    @classmethod
    def with_defaults(cls, defaults: dict, temperature=None, top_k=None, top_p=None,
                      repetition_penalty=None) -> "Sampling":
        """The given settings, and the model's generation_config.json defaults for those left None."""
        given = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty)
        chosen = {name: defaults.get(name, getattr(cls, name)) if value is None else value
                  for name, value in given.items()}
        try:
            return cls(**chosen)
        except BadSetting as e:
            if given[e.setting] is not None:
                raise
            raise BadSetting(e.setting, e.value, e.allowed, "the model's default, from its generation_config.json; "
                                                            "give the setting to override it") from None


class BadSetting(ValueError):
    """A sampling setting out of its range: which one, its value, the range (for a message in the caller's
    own names: server.py's params, generate.py's flags)."""

    def __init__(self, setting: str, value, allowed: str, source: str = ""):
        super().__init__(f"{setting} must be {allowed}, got {value!r}" + (f" ({source})" if source else ""))
        self.setting, self.value, self.allowed = setting, value, allowed

    def as_default(self, advice: str) -> str:
        """The message for a model's default out of range, then what the caller's user can do about it."""
        return (f"this model's generation_config.json sets {self.setting} to {self.value!r}, which must be "
                f"{self.allowed}: {advice}")


def finite(x) -> bool:
    """A finite real number (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


# each setting's range, and how a message says it
SAMPLING_RANGES = {
    # below 1e-6, logits / temperature can overflow to inf and the softmax to NaN
    "temperature": (lambda x: finite(x) and (x == 0 or x >= 1e-6), "0 (greedy) or a number from 1e-6 up"),
    "top_k": (lambda x: is_int(x) and 0 <= x < 2**63, "an integer from 0 (no limit) to 2^63 - 1"),
    "top_p": (lambda x: finite(x) and 0 < x <= 1, "a number in (0, 1]"),
    # fp32 holds it (and its inverse) as a normal number: 1e-300 would be 0 there, and the logits inf
    "repetition_penalty": (lambda x: finite(x) and 1e-30 <= x <= 1e30, "a number from 1e-30 to 1e30 (1: none)"),
}


def check_sampling(s: Sampling):
    for name, (ok, allowed) in SAMPLING_RANGES.items():
        value = getattr(s, name)
        if not ok(value):
            raise BadSetting(name, value, allowed)


def on_device(values, device, dtype=torch.int64) -> torch.Tensor:
    """Host values (a list, in `dtype`, or a CPU tensor) on `device` without waiting for the GPU's queue: a copy
    from pageable memory synchronizes with the stream, one from pinned memory does not. The engine prefills
    while a launched block decodes (generate.Engine._run), so every copy on the prefill's way is this one."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class Sampler:
    """What the decode step samples with, per row, in static device buffers: the settings of the request
    each row serves and the token ids its penalty remembers. A new setting is a new value in these tensors,
    never new code, and rows with different settings share one batch."""
    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = no limit
    top_p: torch.Tensor  # [B] fp32
    penalty: torch.Tensor  # [B] fp32, 1 = none
    seen: torch.Tensor  # [B, V] bool: the ids in the row's prompt and output so far
    ROWS: ClassVar = ("temperature", "top_k", "top_p", "penalty", "seen")  # per row (step.first_rows)

    @classmethod
    def empty(cls, batch: int, vocab: int, device):
        f32 = lambda value: torch.full((batch,), value, dtype=torch.float32, device=device)
        return cls(f32(0.0), torch.zeros(batch, dtype=torch.int64, device=device), f32(1.0), f32(1.0),
                   torch.zeros(batch, vocab, dtype=torch.bool, device=device))

    def start(self, rows: list[int], settings: list[Sampling], prompts: list[list[int]]):
        """Rows `rows` (a host list) start serving these requests: their settings, and their prompts' ids seen."""
        device = self.seen.device
        at = on_device(rows, device)
        for name, attr in (("temperature", "temperature"), ("top_k", "top_k"), ("top_p", "top_p"),
                           ("penalty", "repetition_penalty")):
            buffer = getattr(self, name)
            buffer[at] = on_device([getattr(s, attr) for s in settings], device, buffer.dtype)
        self.seen.index_fill_(0, at, False)  # (index_fill_: cache.KVCache.reset says why)
        for row, prompt in zip(rows, prompts):
            self.seen[row].index_fill_(0, on_device(prompt, device), True)

    def pick(self, logits, seeds, positions, rows=None, hot: bool = True):
        """The next token of rows `rows` (default: all) from their logits [n, V]; marks it seen. hot=False
        when no row samples: the argmax alone, without sample()'s sort of the vocabulary."""
        at = slice(None) if rows is None else rows  # the decode step: every row, views rather than copies
        logits = apply_penalty(logits, self.seen[at], self.penalty[at])
        # eagerly the function itself: an op's first call imports torch's compiler (1.3 s of an eager process's start)
        draw = sample_op if torch.compiler.is_compiling() else sample
        nxt = draw(logits, seeds, positions, self.temperature[at], self.top_k[at], self.top_p[at]) if hot \
            else logits.argmax(-1)
        rows = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows
        self.seen.index_put_((rows, nxt), torch.ones_like(nxt, dtype=torch.bool))
        return nxt

    def read(self, cols, tokens: list[list[int]]) -> list[list[int]]:
        """What each row's output keeps of the steps in ring columns cols: their tokens (Forcing.read: records)."""
        return tokens


def seeds_for(n: int, seed, draw=lambda: random.randrange(2**31)) -> list[int]:
    """One sampling seed per prompt, so that a prompt's samples do not depend on its row: seed + i for
    prompt i from one int (None: draw()), or the n ints given."""
    if not isinstance(seed, (list, tuple)):
        seed = draw() if seed is None else seed
        seed = [int(seed) + i for i in range(n)] if is_int(seed) else [seed]
    if len(seed) != n or not all(map(is_int, seed)):
        raise ValueError(f"seed must be one int or one int per prompt ({n}); got {seed!r}")
    seed = [int(s) for s in seed]
    if not all(-2**63 <= s < 2**63 for s in seed):  # the decode step keeps them in an int64 tensor
        raise ValueError(f"seeds must fit in 64 bits (-2**63 <= seed < 2**63; with one seed, prompt i gets "
                         f"seed + i); got {max(seed, key=abs)}")
    return seed


def settings_for(n: int, sampling) -> list[Sampling]:
    """One Sampling per prompt, from one for all or a list of n."""
    sampling = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
    if len(sampling) != n or not all(isinstance(s, Sampling) for s in sampling):
        raise ValueError(f"sampling must be one Sampling or one per prompt ({n})")
    return sampling
