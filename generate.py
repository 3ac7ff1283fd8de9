"""Prefill, the compiled decode step, CUDA-graph replay, sampling, the generation loop, and the command line.

    python generate.py --model Qwen/Qwen3-8B --budget 3200 --prompt "How many primes are below 100?"

The decode step is one small function. It reads and advances its own state in place (current tokens,
positions, the output history), so the host only replays it: compiled once with torch.compile, captured
once as a CUDA graph, never synchronised with inside the step. The host looks at the output every
`sync_every` steps to stop at EOS and to stream text.
"""
import argparse
import random
import sys
import time
from dataclasses import dataclass

import torch

from cache import KVCache, check_budget
from model import Transformer, load

# ---- sampling without host syncs ---------------------------------------------------------------------
MASK32 = 0xFFFFFFFF


def hash32(x):
    """An integer hash (lowbias32) on int64 tensors holding 32-bit values; products are masked back to
    32 bits, so int64 wrap-around never matters."""
    x = x & MASK32
    for mul in (0x7FEB352D, 0x846CA68B):
        x = ((x ^ (x >> 16)) * mul) & MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds, positions, vocab: int):
    """Uniform (0, 1) noise [B, vocab] that depends only on (seed, position, token id): the same prompt
    and seed give the same sample in any batch, on any device, with no generator state to capture."""
    row = hash32(seeds * 0x9E3779B1 + positions)  # [B]
    x = hash32(row[:, None] * 0x85EBCA77 + torch.arange(vocab, device=seeds.device))  # [B, V]
    return ((x >> 8).float() + 0.5) / 2**24  # top 24 bits: exact in fp32, never 0 or 1


def sample(logits, seeds, positions, temperature: float, top_k: int, top_p: float):
    """logits: [B, V] fp32; positions: [B], the positions of the tokens being sampled. Returns [B]."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token once the more likely tokens before it already cover top_p
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    # argmax(p / E) with E ~ Exponential(1) is a draw from p (the exponential-race trick)
    return (probs / -uniform_noise(seeds, positions, logits.shape[-1]).log()).argmax(-1)


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


# ---- the decode step ---------------------------------------------------------------------------------
@dataclass
class State:
    """Everything the decode step reads and advances, in static device buffers (CUDA-graph safe)."""
    tokens: torch.Tensor  # [B] the last token of each sequence, not yet in the cache
    positions: torch.Tensor  # [B] its position
    seeds: torch.Tensor  # [B]
    history: torch.Tensor  # [B, max_new] generated tokens
    count: torch.Tensor  # [1] how many tokens of history are written


def decode_step(model: Transformer, cache: KVCache, state: State, s: Sampling):
    logits = model(state.tokens[:, None], state.positions[:, None], cache)[:, 0]  # [B, V]
    nxt = sample(logits, state.seeds, state.positions + 1, s.temperature, s.top_k, s.top_p)  # [B]
    state.history.index_copy_(1, state.count, nxt[:, None])
    state.tokens.copy_(nxt)
    state.positions.add_(1)
    state.count.add_(1)


class Stepper:
    """Runs decode_step: compiled (fullgraph, static shapes) and, on CUDA, replayed as a CUDA graph.
    Compilation and capture happen here, on the empty cache, which is then emptied again (the warm-up
    steps wrote one junk token that is simply marked as an empty slot)."""

    def __init__(self, model, cache, state, sampling, compile=True):
        self.args = (model, cache, state, sampling)
        self.fn = torch.compile(decode_step, fullgraph=True, dynamic=False) if compile else decode_step
        self.graph = None
        if state.tokens.is_cuda:
            stream = torch.cuda.Stream()  # warm up (compile, autotune, allocate) off the capture stream
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.fn(*self.args)
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.fn(*self.args)
        else:
            self.fn(*self.args)
        cache.reset()

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn(*self.args)


# ---- the generation loop ------------------------------------------------------------------------------
@dataclass
class Stats:
    prompt_tokens: int
    generated_tokens: int
    setup_s: float  # compiling the step and capturing its graph (0 when reused)
    prefill_s: float
    decode_s: float
    slots: int  # KV slots per sequence and layer
    kv_bytes: int
    full_kv_bytes: int  # what a cache holding every token would need at the final length

    def line(self) -> str:
        rate = self.generated_tokens / max(self.prefill_s + self.decode_s, 1e-9)
        return (f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok in "
                f"{self.prefill_s + self.decode_s:.2f} s ({rate:.1f} tok/s; prefill {self.prefill_s:.2f} s, "
                f"compile {self.setup_s:.1f} s); KV cache {self.slots} slots/seq, "
                f"{self.kv_bytes / 2**20:.1f} MiB (a full cache would need {self.full_kv_bytes / 2**20:.1f} MiB)")


def check_memory(needed: int, device):
    """Refuse, before allocating, a cache (and prefill working memory) that cannot fit in free GPU memory."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if needed > free:
        raise ValueError(f"the KV cache and prefill need {needed / 2**30:.2f} GiB but only "
                         f"{free / 2**30:.2f} GiB of GPU memory is free; lower the batch size, "
                         f"--max-new-tokens or --budget")


def prefill(model, cache, prompts: list[list[int]], state: State, s: Sampling):
    """Run the right-padded prompts through the model into the cache; sample each first new token."""
    device = state.tokens.device
    T = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), T, dtype=torch.int64)
    positions = torch.full((len(prompts), T), -1, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = torch.tensor(p)
        positions[i, :len(p)] = torch.arange(len(p))
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    logits = model(tokens.to(device), positions.to(device), cache, prefill=True, last=lengths - 1)
    first = sample(logits, state.seeds, lengths, s.temperature, s.top_k, s.top_p)
    state.tokens.copy_(first)
    state.positions.copy_(lengths)
    state.history[:, 0] = first
    state.count.fill_(1)


class Engine:
    """Owns the model and, per batch shape, the cache, the state buffers and the compiled step."""

    def __init__(self, model: Transformer, compile=True, sync_every=16):
        self.model, self.compile, self.sync_every = model, compile, sync_every
        self.key = self.stepper = self.cache = self.state = None  # of the last batch shape

    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
                 budget: int | None = None, policy: str = "longflow", sampling: Sampling = Sampling(),
                 seed: int | None = None, on_tokens=None) -> tuple[list[list[int]], Stats]:
        """Generate for a batch of token-id prompts; returns the new ids of each (EOS included when
        produced) and the run's statistics. on_tokens(row0_new_ids) streams the first sequence."""
        check_request(prompts, max_new_tokens, budget, policy)
        if budget is None or policy == "full":
            policy, budget = "full", max(map(len, prompts)) + max_new_tokens
        cfg, device = self.model.cfg, self.model.model.embed_tokens.weight.device
        dtype = self.model.model.embed_tokens.weight.dtype
        if max(max(p) for p in prompts) >= cfg.vocab_size or min(min(p) for p in prompts) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {cfg.vocab_size}) for this model")
        cache_bytes = KVCache.bytes_needed(cfg, len(prompts), budget, dtype)
        work_bytes = prefill_work_bytes(cfg, prompts, dtype)
        t0 = sync_time(device)
        stepper, cache, state = self._prepare(len(prompts), budget, max_new_tokens, policy, sampling,
                                              device, dtype, cache_bytes + work_bytes)
        seed = random.randrange(2**31) if seed is None else seed
        state.seeds.copy_(torch.arange(len(prompts)) + seed)
        t1 = sync_time(device)
        prefill(self.model, cache, prompts, state, sampling)
        t2 = sync_time(device)
        outs = self._decode_loop(stepper, state, max_new_tokens, set(eos_ids), on_tokens)
        t3 = sync_time(device)
        final_len = max(len(p) + len(o) for p, o in zip(prompts, outs))
        stats = Stats(sum(map(len, prompts)), sum(map(len, outs)), t1 - t0, t2 - t1, t3 - t2, budget,
                      cache_bytes, cfg.kv_bytes_per_token(dtype) * final_len * len(prompts))
        return outs, stats

    def _prepare(self, batch, slots, max_new, policy, sampling, device, dtype, needed_bytes):
        """Reuse the cache, buffers and captured graph when the shape and settings repeat."""
        key = (batch, slots, max_new, policy, sampling)
        if self.key == key:
            self.cache.reset()
            return self.stepper, self.cache, self.state
        self.key = self.stepper = self.cache = self.state = None  # free the old cache, then measure
        if device.type == "cuda":
            torch.cuda.empty_cache()
        check_memory(needed_bytes, device)
        cache = KVCache(self.model.cfg, batch, slots, device, dtype, policy)
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)
        state = State(z(batch), z(batch), z(batch), z(batch, max_new), z(1))
        stepper = Stepper(self.model, cache, state, sampling, self.compile)
        self.key, self.stepper, self.cache, self.state = key, stepper, cache, state
        return stepper, cache, state

    def _decode_loop(self, stepper, state, max_new, eos, on_tokens):
        B = state.tokens.shape[0]
        outs, done = [[] for _ in range(B)], [False] * B
        seen, written = 0, 1  # prefill wrote the first token
        while True:
            new = state.history[:, seen:written].tolist()  # the host sync, once every sync_every steps
            seen = written
            for b in range(B):
                for t in new[b] if not done[b] else ():
                    outs[b].append(t)
                    if t in eos:
                        break
                done[b] = bool(outs[b]) and outs[b][-1] in eos or len(outs[b]) == max_new
            if on_tokens:
                on_tokens(outs[0])
            if all(done):
                return outs
            n = min(self.sync_every, max_new - written)
            for _ in range(n):
                stepper()
            written += n


def check_request(prompts, max_new_tokens, budget, policy):
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: give at least one token of prompt text")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    check_budget(budget, policy)


def prefill_work_bytes(cfg, prompts, dtype) -> int:
    """A rough bound on prefill's transient memory: activations and MLP of the whole batch, one layer's
    K/V expanded to all query heads, and logits."""
    tokens = len(prompts) * max(map(len, prompts))
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size + 4 * cfg.n_heads * cfg.head_dim)
    return tokens * per_token * dtype.itemsize + len(prompts) * cfg.vocab_size * 4


def sync_time(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def pick_device(device: str | None, dtype: str | torch.dtype | None):
    """CUDA when available, else CPU; bfloat16 on CUDA, float32 on CPU, unless asked otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA was asked for but is not available on this machine; use --device cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    return device, dtype


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---- the command line ---------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of argparse's usage block
        self.exit(2, f"error: {message} (see --help)\n")


def parse_args(argv=None):
    p = Parser(prog="generate.py", description="Generate text with LongFlow KV-cache compression.")
    p.add_argument("--model", default="Qwen/Qwen3-0.6B", help="Hugging Face id or local folder")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="a file whose whole content is the prompt")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: when it has one)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=True,
                   help="let Qwen3 think before answering (its chat template's enable_thinking)")
    p.add_argument("--budget", type=positive_int, default=None,
                   help="KV slots per sequence and layer (default: keep every token)")
    p.add_argument("--policy", default="longflow", help="longflow (per layer), longflow-head, full")
    p.add_argument("--max-new-tokens", type=positive_int, default=512)
    p.add_argument("--temperature", type=float, default=None, help="default: generation_config.json")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--batch-size", type=positive_int, default=1, help="sequences generated together")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-compile", action="store_true", help="run the decode step eagerly")
    return p.parse_args(argv)


def read_prompt(args) -> str:
    if args.prompt_file is None:
        return args.prompt if args.prompt is not None else "Briefly, why is the sky blue?"
    try:
        with open(args.prompt_file) as f:
            return f.read()
    except OSError as e:
        raise FileNotFoundError(f"cannot read prompt file {args.prompt_file}: {e.strerror}") from None


def sampling_from(args, defaults: dict) -> Sampling:
    pick = lambda name, default: getattr(args, name) if getattr(args, name) is not None else defaults.get(name, default)
    s = Sampling(float(pick("temperature", 0.0)), int(pick("top_k", 0)), float(pick("top_p", 1.0)))
    if s.temperature < 0 or s.top_k < 0 or not 0 < s.top_p <= 1:
        raise ValueError("need temperature >= 0, top-k >= 0 and 0 < top-p <= 1")
    return s


def run(args):
    text = read_prompt(args)
    if not text.strip():
        raise ValueError("the prompt is empty; give some text with --prompt or --prompt-file")
    check_budget(args.budget, args.policy)
    device, dtype = pick_device(args.device, args.dtype)
    model, tok = load(args.model, device, dtype)
    chat = tok.template is not None if args.chat is None else args.chat
    ids = tok.chat([{"role": "user", "content": text}], args.thinking) if chat else tok.encode(text)
    engine = Engine(model, compile=not args.no_compile)
    printed = []

    def stream(new_ids):  # print the text decoded so far, past what is already on screen
        out = tok.decode(new_ids)
        print(out[len(printed[0]) if printed else 0:], end="", flush=True)
        printed[:] = [out]

    outs, stats = engine.generate([ids] * args.batch_size, args.max_new_tokens, tok.eos_ids, args.budget,
                                  args.policy, sampling_from(args, tok.defaults), args.seed,
                                  stream if args.batch_size == 1 else None)
    if args.batch_size > 1:
        for i, o in enumerate(outs):
            print(f"--- sequence {i} ---\n{tok.decode(o)}")
    print("\n" + stats.line())


def main(argv=None):
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
