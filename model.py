"""The transformer (Qwen3, Qwen2 / R1-Distill-Qwen, Llama / R1-Distill-Llama), its config, and loading
Hugging Face checkpoints and tokenizers. Module paths equal the checkpoint's tensor names
(`model.layers.3.self_attn.o_proj.weight`), except that q/k/v and gate/up are stored fused (FUSED)."""
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import jinja2.sandbox
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer as HFTokenizer

import default_model
import fp8
from cache import KVCache, Layer
from calibration import cache_folder
from policies import is_int
from sampling import on_device
from parallel import SINGLE, Group, rank

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
SUPPORTED = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


@dataclass
class Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, or None for plain RoPE
    tie_embeddings: bool
    qkv_bias: bool  # Qwen2
    qk_norm: bool  # Qwen3
    eos_token_id: list
    max_position_embeddings: int | None  # the trained context (None: not stated); longer is refused
    fp8_blocks: bool = False  # the checkpoint stores its layers' linear weights in FP8 blocks (fp8.py)

    @classmethod
    def from_dict(cls, c: dict) -> "Config":
        """The config.json of a supported checkpoint, checked first (check_config: a clear error for
        anything tinyflow would misread)."""
        check_config(c)
        c = without_nulls(c)
        rope = rope_parameters(c)
        heads, kv_heads, head_dim = attention_shape(c)
        kind, eos = c.get("model_type"), c.get("eos_token_id")
        return cls(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"], n_layers=c["num_hidden_layers"],
            n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta(c, rope),
            rope_scaling={k: rope[k] for k in LLAMA3_KEYS} if rope_type(rope) == "llama3" else None,
            tie_embeddings=c.get("tie_word_embeddings", False),
            qkv_bias=kind == "qwen2" or c.get("attention_bias", False),
            qk_norm=kind == "qwen3",
            eos_token_id=[] if eos is None else eos if isinstance(eos, list) else [eos],
            max_position_embeddings=c.get("max_position_embeddings"),
            fp8_blocks="quantization_config" in c)


def without_nulls(c: dict) -> dict:
    """null counts as absent, as transformers reads it."""
    return {k: v for k, v in c.items() if v is not None}


def rope_parameters(c: dict) -> dict:
    # transformers >= 5 writes `rope_parameters`; checkpoints on the Hub have rope_theta + rope_scaling
    return c.get("rope_parameters") or c.get("rope_scaling") or {}


def rope_theta(c: dict, rope: dict) -> float:
    theta = rope.get("rope_theta")
    return c.get("rope_theta", 10000.0) if theta is None else theta


def rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def attention_shape(c: dict) -> tuple[int, int, int]:
    """Query heads, KV heads (default: as many as the heads) and head_dim (default: hidden_size / heads)."""
    heads = c["num_attention_heads"]
    return heads, c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads


# ---- config.json's checks -------------------------------------------------------------------------------
def check_config(c):
    """Every check of a config.json, in this order (a bad config gets the first one's message): a clear
    error for anything tinyflow would misread (wrong types, sizes that cannot work, features it does not
    run)."""
    if not isinstance(c, dict):
        raise ValueError(f"config.json must hold a JSON object, not a {type(c).__name__}")
    c = without_nulls(c)
    check_types(c)
    kind = c.get("model_type")
    archs = c.get("architectures") or [SUPPORTED.get(kind, kind)]
    if kind not in SUPPORTED or archs[0] not in SUPPORTED.values():
        raise ValueError(f"unsupported model {archs[0]!r} (model_type {kind!r}); tinyflow runs "
                         f"{', '.join(SUPPORTED.values())}")
    # transformers applies the window to the layers that layer_types marks, whatever use_sliding_window says
    sliding = "sliding_attention" in (c.get("layer_types") or [])
    if c.get("use_sliding_window") or sliding or (kind == "mistral" and c.get("sliding_window")):
        raise ValueError("sliding-window attention is not supported (use_sliding_window, layer_types or "
                         "sliding_window in config.json); tinyflow runs full attention")
    if c.get("mlp_bias"):
        raise ValueError("MLP biases are not supported (mlp_bias is true in config.json)")
    check_rope(c)
    if "quantization_config" in c:
        fp8.check_quantization_config(c["quantization_config"])
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in c]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    heads, kv_heads, head_dim = attention_shape(c)
    if heads % kv_heads or head_dim % 2 or (not c.get("head_dim") and c["hidden_size"] % heads):
        raise ValueError(f"config.json: {heads} attention heads, {kv_heads} KV heads and head_dim {head_dim} "
                         f"do not fit together (the KV heads must divide the heads, head_dim be even and, "
                         f"when not given, hidden_size / heads a whole number)")


def check_rope(c: dict):
    """RoPE's parameters: an object, a positive theta, and no scaling or llama3's, complete."""
    rope = rope_parameters(c)
    if not isinstance(rope, dict):
        raise ValueError(f"config.json: rope_parameters / rope_scaling must be an object, got {rope!r}")
    theta = rope_theta(c, rope)
    if not (is_number(theta) and theta > 0):
        raise ValueError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    kind = rope_type(rope)
    if kind not in ("default", "llama3"):
        raise ValueError(f"unsupported rope scaling {kind!r}; tinyflow supports none and 'llama3'")
    if kind == "llama3" and not set(LLAMA3_KEYS) <= set(rope):
        raise ValueError(f"llama3 rope scaling in config.json lacks {sorted(set(LLAMA3_KEYS) - set(rope))}")
    if kind == "llama3" and not all(is_number(rope[k]) and rope[k] > 0 for k in LLAMA3_KEYS):
        raise ValueError(f"llama3 rope scaling in config.json: {', '.join(LLAMA3_KEYS)} must be positive numbers")


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "max_position_embeddings")


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_types(c: dict):
    """config.json's values are of the right kind."""
    def fail(key, what):
        raise ValueError(f"config.json: {key} must be {what}, got {c[key]!r}")
    if not isinstance(c.get("model_type", ""), str):
        fail("model_type", "a string")
    for key in ("architectures", "layer_types"):
        if key in c and not (isinstance(c[key], list) and all(isinstance(x, str) for x in c[key])):
            fail(key, "a list of strings")
    for key in SIZES:
        if key in c and not (is_int(c[key]) and c[key] > 0):
            fail(key, "a positive integer")
    if "rms_norm_eps" in c and not (is_number(c["rms_norm_eps"]) and c["rms_norm_eps"] > 0):
        fail("rms_norm_eps", "a positive number")
    for key in ("tie_word_embeddings", "attention_bias", "use_sliding_window", "mlp_bias"):
        if key in c and not isinstance(c[key], bool):
            fail(key, "true or false")
    eos = c.get("eos_token_id")
    if eos is not None and not all(is_int(e) and e >= 0 for e in (eos if isinstance(eos, list) else [eos])):
        fail("eos_token_id", "a token id or a list of them")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # normalise in fp32, cast back before the weight, as the reference implementation does
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_frequencies(cfg: Config, device) -> torch.Tensor:
    """Inverse frequencies [head_dim/2]; llama3 scaling stretches the low frequencies for long context."""
    d = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d)
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    old_ctx, factor = s["original_max_position_embeddings"], s["factor"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / s["low_freq_factor"], old_ctx / s["high_freq_factor"]
    # long wavelengths are divided by `factor`, short ones kept, the band between blended smoothly
    smooth = (old_ctx / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_band, blended, scaled)


def rotate(x, cos, sin):
    """RoPE in the 'rotate half' layout of HF checkpoints. x: [B, T, H, D]; cos, sin: [B, T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def prefill_attention(q, k, v):
    """Causal attention over right-padded prompts (each row of positions 0, 1, 2, ..., then padding -1, as
    the engine prefills them). q: [B, H_q, T, D]; k, v: [B, H_kv, T, D]. No mask is needed: a real query's
    earlier keys are all real, so SDPA's causal kernel (a flash-attention kernel, never T x T scores)
    gives their outputs exactly; padding queries get finite outputs, which are discarded. (Transformer.forward
    checks the order, once for all layers.)"""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, H_q, T, D]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def in_order(positions) -> bool:
    """Each row of positions [B, T] is 0, 1, 2, ..., then only padding (-1). A host sync, where they are on a GPU."""
    ramp = torch.arange(positions.shape[1], device=positions.device)
    padding_after_tokens = (positions[:, 1:] < 0).ge(positions[:, :-1] < 0)
    return bool(((positions == ramp) | (positions < 0)).all() and padding_after_tokens.all())


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.sizes = [q_dim, kv_dim, kv_dim]  # qkv_proj's rows: the checkpoint's q_proj, k_proj, v_proj
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3 normalises each head of q and k before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, positions, cache: KVCache, layer: Layer, rows):
        B, T, _ = x.shape
        c = self.cfg
        q, k, v = (t.view(B, T, -1, c.head_dim) for t in self.qkv_proj(x).split(self.sizes, dim=-1))  # [B, T, H, D]
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        if rows is not None:  # prefill whole prompts into these cache rows
            out = prefill_attention(q, k, v)  # [B, H_q, T, D]
            cache.prefill(layer, q, k, v, positions, rows)
        else:
            out = cache.decode(layer, q[:, :, 0], k[:, :, 0], v[:, :, 0], positions[:, 0])[:, :, None]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.sizes = [cfg.intermediate_size] * 2  # gate_up_proj's rows: the checkpoint's gate_proj, up_proj
        self.gate_up_proj = nn.Linear(cfg.hidden_size, sum(self.sizes), bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.sizes, dim=-1)
        return self.down_proj(F.silu(gate) * up)


MLP_TOKENS = 8192  # prefill runs the MLP over at most this many tokens at once (its activations are the largest)


class Block(nn.Module):
    def __init__(self, cfg: Config, tp: Group):
        super().__init__()
        self.tp = tp  # tensor parallel: each rank's attention and MLP give partial sums of the whole layer's
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, positions, cache, layer, rows):
        x = x + self.tp.sum(self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, layer, rows))
        if x.shape[0] * x.shape[1] <= MLP_TOKENS:
            return x + self.tp.sum(self.mlp(self.post_attention_layernorm(x)))
        flat = x.view(-1, x.shape[-1])  # a long prefill: the MLP's [tokens, 3 x intermediate] a chunk at a time
        return torch.cat([t + self.tp.sum(self.mlp(self.post_attention_layernorm(t)))
                          for t in flat.split(MLP_TOKENS)]).view_as(x)


class Transformer(nn.Module):
    def __init__(self, cfg: Config, tp: Group = SINGLE):
        """tp: the ranks the model is split over (parallel.py); cfg is then this rank's part (its heads and
        MLP share: tp.shard), full_cfg the whole model's."""
        super().__init__()
        self.full_cfg, self.cfg, self.tp = cfg, tp.shard(cfg), tp
        cfg = self.cfg
        self.model = nn.Module()
        # its weight left uninitialised, as empty_model leaves every weight: nn.Embedding's own init on the meta
        # device imports torch's compiler (1.3 s of every process's start)
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                               _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.model.layers = nn.ModuleList(Block(cfg, tp) for _ in range(cfg.n_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.vocab_part = tp.vocab_part(cfg.vocab_size)  # the lm_head rows of this rank (all of them without TP)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, len(range(cfg.vocab_size)[self.vocab_part]), bias=False)
        self.register_buffer("inv_freq", rope_frequencies(cfg, "cpu"), persistent=False)
        self.folder = None  # the checkpoint folder load() read it from (None: made otherwise)

    def forward(self, tokens, positions, cache: KVCache, rows=None, last=None, run_block=Block.__call__):
        """tokens, positions: [B, T] (position -1 marks padding). Decodes one token per cache row, or, with
        `rows` [B] (int64, on the cache's device), prefills whole prompts into those cache rows. Returns logits
        [B, T, V], or [B, V] at index `last` [B] of each row when given (prefill needs only the last prompt
        token's logits).
        run_block(block, ...) runs each layer: the decode step passes one compiled function for them all.
        Prefill takes right-padded prompts (each row's positions 0, 1, 2, ..., then -1): its attention needs
        no mask (prefill_attention), so other orders are refused here, once for all layers: on positions given
        on the CPU (the engine's), without a host sync."""
        if rows is not None and not in_order(positions):
            raise ValueError("prefill takes right-padded prompts: each row's positions 0, 1, 2, ..., then -1")
        return self.run(tokens, on_device(positions, tokens.device), cache, rows, last, run_block)

    def run(self, tokens, positions, cache: KVCache, rows=None, last=None, run_block=Block.__call__):
        """forward without the prefill's order check, positions on the tokens' device: what a CUDA graph of the
        prefill captures (step.PrefillGraphs; its engine pads the prompts itself)."""
        x = self.model.embed_tokens(tokens)  # [B, T, hidden]
        freqs = positions.clamp(min=0)[..., None].float() * self.inv_freq  # [B, T, D/2], fp32 like HF
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # [B, T, 1, D]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block, layer in zip(self.model.layers, cache.layers):
            x = run_block(block, x, cos, sin, positions, cache, layer, rows)
        if last is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last]  # [B, hidden]
        x = self.model.norm(x)
        return self.tp.gather_vocab(self.head(x), self.cfg.vocab_size).float()

    def head(self, x):
        """The LM head, this rank's rows of the vocabulary: [..., hidden] -> [..., V]. Tied to the embedding unless
        the model has a head of its own (an untied checkpoint's, or a quantized copy: fp8.quantize_head)."""
        if self.embedding_is_head:
            return F.linear(x, self.model.embed_tokens.weight[self.vocab_part])
        return self.lm_head(x)

    @property
    def embedding_is_head(self) -> bool:
        return "lm_head" not in self._modules


# ---------------------------------------------------------------------------------------------------
# Loading: a local folder or a Hub id; config, safetensors weights (sharded or not), tokenizer.

# "model*.safetensors": the transformers names (model.safetensors, model-00001-of-00004.safetensors), not
# the copies in other formats some repositories also hold (consolidated.safetensors)
HUB_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "model*.safetensors", "model.safetensors.index.json"]


# the Hub's owners of the supported families, by how their bare names begin (Qwen3-8B is Qwen/Qwen3-8B)
HUB_OWNERS = {"Qwen3-": "Qwen", "Qwen2.5-": "Qwen", "QwQ-32B": "Qwen", "DeepSeek-R1-Distill-": "deepseek-ai",
              "Llama-3.1-": "meta-llama"}


def hub_id(name: str) -> str | None:
    """A bare name of a supported family as its Hub id (Qwen3-8B: Qwen/Qwen3-8B), else None."""
    owner = next((owner for start, owner in HUB_OWNERS.items() if name.startswith(start)), None)
    return f"{owner}/{name}" if owner and "/" not in name else None


def resolve(name: str | None) -> str:
    """A local folder as is; a bare name of a supported family (Qwen3-8B) as its Hub id, said on stderr; anything
    else is a Hub id, fetched (or found in the local cache). None: the default model (default_model.py), converted
    once into tinyflow's cache folder."""
    if name is None:
        return default_folder()
    name = os.path.expanduser(name)  # `--model=~/dir`: the shell leaves that tilde alone
    if os.path.isdir(name):
        return name
    if os.path.exists(name):
        raise ValueError(f"{name} is a file, not a model folder: give the folder that holds config.json, "
                         f"*.safetensors and tokenizer.json")
    if hub_id(name):
        if rank() == 0:
            print(f"model {name!r}: no such folder here, so the Hugging Face Hub's {hub_id(name)}", file=sys.stderr)
        name = hub_id(name)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(f"model path {name!r} does not exist (give a local folder or a Hub id "
                                f"like Qwen/Qwen3-8B)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError
    try:
        return snapshot_download(name, allow_patterns=HUB_FILES)
    except LocalEntryNotFoundError:
        raise FileNotFoundError(f"{name} is not in the local Hugging Face cache and could not be downloaded "
                                f"(no network, or HF_HUB_OFFLINE set); fetch it with `hf download {name}`") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{name} is neither a local folder nor a model on the Hugging Face Hub") from None


def default_folder() -> str:
    """The model a run without one gets: SmolLM2-135M-Instruct, in <cache>/models (cache as calibration.py's)."""
    say = (lambda line: print(line, file=sys.stderr)) if rank() == 0 else (lambda line: None)
    folder = default_model.cached(cache_folder() / "models", say)
    say(f"no model given: running {default_model.NAME} ({folder})")
    return folder


def read_json(folder: str, name: str, required=True) -> dict:
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        if required:
            raise FileNotFoundError(f"{path} is missing; is {folder} a Hugging Face model folder?")
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{path} must hold a JSON object, not a {type(content).__name__}")
    return content


# Projections that read the same input are one matrix in the model, so a decode step runs one GEMM (a GEMV
# at batch 1) where it would run three or two; the checkpoint stores the parts under their own names.
FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def checkpoint_params(model: Transformer) -> dict[str, torch.Tensor]:
    """Every tensor the checkpoint fills, by its name there: the parameters, each fused projection split
    into row views named after its parts (filling the views fills the fused matrix)."""
    params = {}
    for name, p in model.named_parameters():
        owner, _, rest = name.rpartition(".")  # e.g. "model.layers.0.self_attn.qkv_proj", "weight"
        parent, _, module = owner.rpartition(".")
        if module not in FUSED:
            params[name] = p
            continue
        sizes = model.get_submodule(parent).sizes
        if rest == "weight_scale_inv":  # FP8 blocks: each part's own rows of block factors
            sizes = [-(-size // fp8.BLOCK) for size in sizes]
        for part, rows in zip(FUSED[module], p.split(sizes)):
            params[f"{parent}.{part}.{rest}"] = rows
    return params


def load_weights(model: Transformer, folder: str, device, dtype):
    """Fill every parameter exactly once from the safetensors files, straight to device and dtype."""
    index = read_json(folder, "model.safetensors.index.json", required=False)
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    params = checkpoint_params(model)
    filled = set()
    for file in files:
        path = os.path.join(folder, file)
        if not os.path.exists(path):
            raise FileNotFoundError(f"weights file {path} is missing")
        try:
            with safe_open(path, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if name == "lm_head.weight" and model.cfg.tie_embeddings:
                        continue  # a stored copy of the tied embedding: the embedding is used, as in transformers
                    if name not in params or name in filled:
                        raise unexpected(name, file)
                    t = read_part(f, name, params[name].shape, model)
                    check_floating(name, file, t, params[name])
                    if t.shape != params[name].shape:
                        raise ValueError(f"weight {name!r} has shape {list(t.shape)}, the config implies "
                                         f"{list(params[name].shape)}")
                    with torch.no_grad():  # in the model's dtype, but FP8 blocks and their factors as stored
                        params[name].copy_(t.to(params[name].dtype))
                    check_finite(name, file, t, params[name])
                    filled.add(name)
        except SafetensorError as e:  # a truncated or corrupt file
            raise ValueError(f"cannot read weights file {path}: {e}") from None
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {missing[0]!r}")


def unexpected(name: str, file: str) -> ValueError:
    if name.endswith("weight_scale_inv"):
        return ValueError(f"{file} holds FP8 block factors ({name}) but config.json has no quantization_config: "
                          f"restore the checkpoint's config.json")
    return ValueError(f"unexpected weight {name!r} in {file}: the model has no such parameter (or it appeared twice)")


def tp_split(name: str, cfg: Config) -> tuple[int, int, int] | None:
    """How tensor parallel splits the checkpoint's tensor `name` (cfg: the whole model's): along dim, in
    `units` equal units of `size` rows or columns (heads of head_dim, MLP or vocabulary rows of 1), each rank
    taking its share of units; None: every rank holds it whole (embedding, norms)."""
    kind = name.split(".")[-2]  # "q_proj" in "model.layers.0.self_attn.q_proj.weight", "bias" too
    heads = {"q_proj": cfg.n_heads, "k_proj": cfg.n_kv_heads, "v_proj": cfg.n_kv_heads}
    if kind in heads:
        return 0, heads[kind], cfg.head_dim
    if kind == "o_proj":
        return 1, cfg.n_heads, cfg.head_dim
    if kind in ("gate_proj", "up_proj", "down_proj"):
        return int(kind == "down_proj"), cfg.intermediate_size, 1
    if name == "lm_head.weight":
        return 0, cfg.vocab_size, 1
    return None


def read_part(f, name: str, shape, model: Transformer) -> torch.Tensor:
    """The tensor `name` of safetensors file f, or under tensor parallel only this rank's rows or columns
    of it (safetensors' get_slice reads just those bytes). A stored tensor whose whole shape is not the one
    the config implies is refused, naming both."""
    split = tp_split(name, model.full_cfg) if model.tp.size > 1 else None
    if split is None:
        return f.get_tensor(name)
    dim, units, size = split
    stored = f.get_slice(name)
    whole = list(shape)
    whole[dim] = units * size
    part = model.tp.vocab_part(units) if name == "lm_head.weight" else model.tp.part(units)
    at = slice(part.start * size, part.stop * size)
    if name.endswith("weight_scale_inv"):  # FP8 blocks: a rank's rows or columns are whole blocks (fp8.check_split)
        whole[dim], at = -(-whole[dim] // fp8.BLOCK), slice(at.start // fp8.BLOCK, -(-at.stop // fp8.BLOCK))
    if list(stored.get_shape()) != whole:
        raise ValueError(f"weight {name!r} has shape {list(stored.get_shape())}, the config implies {whole}")
    return stored[at] if dim == 0 else stored[:, at]


def check_floating(name: str, file: str, stored: torch.Tensor, param: torch.Tensor):
    """Integers would be converted to the model's dtype as numbers and generate nonsense: refuse them. Where
    config.json says FP8 blocks, the weight must be e4m3 (its factors would not fit anything else)."""
    if not stored.dtype.is_floating_point:
        raise ValueError(f"weight {name!r} of {file} is stored as {stored.dtype}: tinyflow loads floating-point "
                         f"weights and FP8 blocks (fp8.py), not other quantized ones; dequantize the checkpoint first")
    if param.dtype == fp8.FP8 and stored.dtype != fp8.FP8:
        raise ValueError(f"weight {name!r} of {file} is stored as {stored.dtype}, but config.json's "
                         f"quantization_config says FP8 blocks (float8_e4m3fn): the config is not this checkpoint's")


def check_finite(name: str, file: str, stored: torch.Tensor, loaded: torch.Tensor):
    """A NaN or inf weight makes every logit NaN (and generation empty): name the tensor instead. One fp32
    sum per tensor (no copy of it); only a sum that is not finite is looked at element by element."""
    finite = lambda t: torch.isfinite(t.float() if t.dtype == fp8.FP8 else t).all()  # no isfinite for e4m3
    if torch.isfinite(loaded.sum(dtype=torch.float32)) or finite(loaded):
        return
    if finite(stored):
        raise ValueError(f"weight {name!r} of {file} overflows {loaded.dtype} (values beyond its range); load "
                         f"it in another dtype (--dtype bfloat16 or float32)")
    raise ValueError(f"weight {name!r} of {file} holds NaN or infinite values: the checkpoint is damaged")


def empty_model(cfg: Config, device, dtype, tp: Group = SINGLE, fp8_blocks: bool = False) -> Transformer:
    """The model (this rank's part of it, under tensor parallel) with uninitialised weights on `device`, in dtype
    (fp8_blocks: the layers' linears as FP8 blocks, for an FP8 checkpoint to fill), allocated once and in their
    final dtype (no CPU copy, no float32 copy on the way)."""
    with torch.device("meta"):
        model = Transformer(cfg, tp).to(dtype)
        if fp8_blocks:
            fp8.convert(model, quantize=False)
    # to_empty's work, with torch.empty rather than its empty_like: on a meta tensor that imports torch's symbolic
    # shapes (0.5 s of every process's start)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.inv_freq = rope_frequencies(cfg, device)  # computed, not stored: rebuild after to_empty
    fp8.place(model, device)
    return model.eval().requires_grad_(False)


class Tokenizer:
    """tokenizer.json through `tokenizers`, the model's own chat template through jinja2, EOS ids and
    sampling defaults from generation_config.json."""

    def __init__(self, folder: str, cfg: Config):
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing; tinyflow needs a fast tokenizer (tokenizer.json)")
        try:
            self.tok = HFTokenizer.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"cannot read {path}: {e}") from None
        tc = read_json(folder, "tokenizer_config.json", required=False)
        gen = read_json(folder, "generation_config.json", required=False)
        path = os.path.join(folder, "chat_template.jinja")  # newer checkpoints keep the template here
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                self.template = f.read()
        else:
            self.template = tc.get("chat_template")
            if isinstance(self.template, list):  # [{"name": "default", "template": ...}, ...]
                default = [x for x in self.template if isinstance(x, dict) and x.get("name") == "default"]
                self.template = default[0].get("template") if default else None
            if self.template is not None and not isinstance(self.template, str):
                raise ValueError(f"the chat_template of {folder}/tokenizer_config.json must be a string (a "
                                 f"Jinja template), got {type(self.template).__name__}")
        # the template's bos_token / eos_token: strings, or {"content": ...} in some tokenizer_config.json files
        special = {k: tc.get(k) for k in ("bos_token", "eos_token")}
        self.special = {k: t.get("content") if isinstance(t, dict) else t for k, t in special.items()}
        gen = generation_defaults(gen, os.path.join(folder, "generation_config.json"))
        eos = gen.get("eos_token_id", cfg.eos_token_id)
        self.eos_ids = eos if isinstance(eos, list) else [eos]
        check_vocab(self, cfg, "generation_config.json" if "eos_token_id" in gen else "config.json")
        # sampling as transformers samples: its defaults (temperature 1, top-k 50, top-p 1) for what the file
        # leaves out; without do_sample, greedy
        self.defaults = {k: gen.get(k, default) for k, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 50))}
        if not gen.get("do_sample", False):
            self.defaults = {"temperature": 0.0}
        if "repetition_penalty" in gen:  # applies to greedy decoding too
            self.defaults["repetition_penalty"] = gen["repetition_penalty"]

    @property
    def has_thinking_switch(self) -> bool:
        """Whether the chat template reads enable_thinking (Qwen3's does): else a thinking switch changes nothing."""
        return self.template is not None and "enable_thinking" in self.template

    def encode(self, text: str, special: bool = True) -> list[int]:
        """special: add what the tokenizer adds to the start of a text (BOS for Llama 3); not for a text
        that continues another."""
        # encode_batch, unlike encode, lets go of the GIL while it works: a server's other threads (its HTTP
        # handlers, its engine) keep running while a long prompt is tokenized (the same ids either way)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (from bytes that were not UTF-8): tokenizers cannot take it
            raise ValueError("the text is not valid Unicode (it holds a lone surrogate, as bytes that are not UTF-8 "
                             "become); give UTF-8 text") from None
        return self.tok.encode_batch([text], add_special_tokens=special)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat(self, messages: list[dict], enable_thinking=True) -> list[int]:
        # the template already wrote BOS and friends as text, so no special tokens are added here
        return self.encode(self.render(messages, enable_thinking), special=False)

    def render(self, messages: list[dict], enable_thinking=True, add_generation_prompt=True) -> str:
        """The conversation as the model's chat template writes it, ready for the assistant's turn (unless
        add_generation_prompt is False: then without what the template adds to open that turn)."""
        if self.template is None:
            raise ValueError("this model has no chat template (no chat_template.jinja, and none in "
                             "tokenizer_config.json): give it plain text instead of messages")

        def fail(msg):
            raise ValueError(f"chat template: {msg}")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = fail
        # as transformers provides them: JSON without HTML escaping (tool schemas), and today's date (Llama 3.2)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
        messages = template_messages(messages)
        try:
            return env.from_string(self.template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                **self.special)
        except ValueError:  # raise_exception's, already a clear message
            raise
        except Exception as e:  # the template is a program from the checkpoint: any other error is the template's
            raise template_failure(e, messages) from None


ROLES = ("system", "developer", "user", "assistant", "tool")  # the OpenAI API's roles


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as a chat template reads them, checked field by field (a bad one is named, not blamed on
    the template): a role of the OpenAI API's, and a content that is a string or OpenAI content parts of type
    text (joined, as server.py joins them); only an assistant's may be missing or null (a turn that only calls
    tools). Keys set to null are left out, as transformers leaves them out. A developer message (OpenAI's
    newer name for the system message) reaches the template as a system message: the templates of Qwen3 and
    DeepSeek-R1 leave out a role they do not know, without a word. A tool message goes as it is (Qwen's
    templates write it as a <tool_response> in a user turn, Llama's as an ipython turn)."""
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} has no 'role' (a string: {', '.join(ROLES)})")
        if m["role"] not in ROLES:
            raise ValueError(f"message {i} has the role {m['role']!r}; a role is one of {', '.join(ROLES)}")
        m = {k: v for k, v in m.items() if v is not None}
        if m["role"] == "developer":
            m["role"] = "system"
        content, who = m.get("content"), f"message {i} ({m['role']})"
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f'{who}: content parts must be {{"type": "text", "text": ...}}: this model reads '
                                 f'text only')
            m["content"] = "".join(p["text"] for p in content)
        elif content is None and m["role"] != "assistant":
            raise ValueError(f"{who} has no 'content': give its text as a string")
        elif content is not None and not isinstance(content, str):
            raise ValueError(f"{who}: 'content' must be a string or a list of text parts, got "
                             f"{type(content).__name__}")
        checked.append(m)
    return checked


def template_failure(e: Exception, messages: list[dict]) -> ValueError:
    """What a failed chat template says: a message without the content the template reads is named (an
    assistant turn may have none); any other error is the template's own."""
    bare = [i for i, m in enumerate(messages) if "content" not in m]
    if isinstance(e, jinja2.UndefinedError) and "'content'" in str(e) and bare:
        return ValueError(f"message {bare[0]} ({messages[bare[0]]['role']}) has no content, which this model's "
                          f"chat template needs: give it one (\"\" for none)")
    return ValueError(f"the model's chat template fails ({type(e).__name__}: {e}); fix chat_template.jinja or "
                      f"tokenizer_config.json's chat_template, or give plain text")


def check_vocab(tok: Tokenizer, cfg: Config, eos_source: str):
    """Token ids the model has no embedding for are refused at load, not when a prompt or EOS first holds
    one. eos_source: the file tok.eos_ids come from."""
    # the highest id: the model's own ids count up from 0, added tokens take theirs (a dict of the whole
    # vocabulary would be slow to build)
    top = max([tok.tok.get_vocab_size(with_added_tokens=False) - 1, *tok.tok.get_added_tokens_decoder()])
    if top >= cfg.vocab_size:
        raise ValueError(f"the tokenizer has ids up to {top} but the model's vocab_size is {cfg.vocab_size}: "
                         f"tokenizer.json is not this model's; use the one that came with its weights")
    for e in tok.eos_ids:
        if not 0 <= e < cfg.vocab_size:
            raise ValueError(f"eos_token_id {e} ({eos_source}) is outside the model's vocabulary of "
                             f"{cfg.vocab_size} ids; fix it in {eos_source}")


def generation_defaults(gen: dict, path: str) -> dict:
    """generation_config.json's settings that tinyflow reads, checked; null means not set (as transformers
    reads it)."""
    gen = {k: v for k, v in gen.items() if v is not None}
    kinds = {"temperature": is_number, "top_p": is_number, "repetition_penalty": is_number, "top_k": is_int,
             "do_sample": lambda x: isinstance(x, bool),
             "eos_token_id": lambda x: all(is_int(e) for e in (x if isinstance(x, list) else [x]))}
    for key, ok in kinds.items():
        if key in gen and not ok(gen[key]):
            raise ValueError(f"{path}: {key} has the wrong type ({gen[key]!r}); fix or remove it")
    return gen


def plural(n: int, word: str) -> str:
    """"1 token", "2 tokens": a count and its noun, for messages."""
    return f"{n} {word}" + ("" if n == 1 else "s")


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}  # what weights load in
# as stored; the layers' linear weights quantized into FP8 blocks at load (fp8.py), as Qwen's FP8 checkpoints hold
# them; those and the LM head
WEIGHTS = ("auto", "fp8", "fp8-all")


def pick_device(device: str | None, dtype: str | torch.dtype | None):
    """CUDA when available, else CPU; bfloat16 on CUDA, float32 on CPU, unless asked otherwise."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise ValueError(f"unsupported device {str(device)!r}; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA was asked for but is not available on this machine; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{device} does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    return device, dtype


def load(name: str | None, device, dtype, tp: Group = SINGLE, weights: str = "auto") -> tuple[Transformer, Tokenizer]:
    """The model (under tensor parallel: this rank's part, read from the files alone) and its tokenizer.
    weights: "auto", the weights as the checkpoint stores them (16-bit, or the layers' linears in FP8 blocks);
    "fp8", 16-bit layers quantized into FP8 blocks as they load; "fp8-all", the LM head quantized too."""
    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    folder = resolve(name)
    cfg = Config.from_dict(read_json(folder, "config.json"))
    tokenizer = Tokenizer(folder, cfg)  # first: a tokenizer the model cannot use is refused before the weights load
    fp8_weights = cfg.fp8_blocks or weights != "auto"
    if fp8_weights:
        fp8.check_split(cfg, tp)
    model = empty_model(cfg, device, dtype, tp, fp8_blocks=cfg.fp8_blocks)  # FP8: filled from the blocks
    load_weights(model, folder, device, dtype)
    fp8.quantize(model, weights, stored_blocks=cfg.fp8_blocks)
    model.folder = folder  # a policy that needs data of this model's own finds it by the checkpoint (Policy.for_model)
    return model, tokenizer
