"""TriAttention's calibration: the statistics of a model's queries that its eviction score reads.

For every layer, attention head and RoPE frequency pair f (the complex number q[f] + i q[f + D/2], RoPE's
"rotate half" layout, which turns it by e^{i p w_f} at position p), the mean over a text's tokens of the query
before RoPE (after Qwen3's q_norm: what multiplies the cached keys) and the mean of its magnitude:

    q_mean     [L, H, F, 2] fp32   the mean complex query (real, imaginary)
    q_abs_mean [L, H, F]    fp32   the mean |query| per pair

`python eval.py calibrate --model DIR` measures them in one prefill over a plain text and writes them, with what
identifies the model (its shapes, RoPE and a fingerprint of its weights), to a cache folder: never into the
model's folder. A policy that reads them (policies.TriAttention) finds them there by the fingerprint.
"""
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

FORMAT = "tinyflow-triattention-1"
CALIBRATE = "python eval.py calibrate --model {}"  # what a refusal tells to run
FINGERPRINT_ROWS = 16  # rows of layer 0's q_proj weight, as stored, that identify a checkpoint


@dataclass(eq=False, repr=False)
class QueryStats:
    """A model's query statistics (module docstring) and its RoPE frequencies w_f [F] (model.rope_frequencies:
    the model's own, llama3 scaling included). Compared by identity (a policy holding them is a dict key)."""
    q_mean: torch.Tensor  # [L, H, F, 2] fp32
    q_abs_mean: torch.Tensor  # [L, H, F] fp32
    inv_freq: torch.Tensor  # [F] fp32

    def __repr__(self):
        return f"QueryStats({list(self.q_abs_mean.shape)})"


# ---- which model: the fingerprint, and where its statistics live ----------------------------------------
def fingerprint(folder) -> str:
    """16 hex digits of the SHA-256 of layer 0's q_proj weight's first rows as the checkpoint stores them
    (dtype, shape and bytes): the same for any dtype, device or tensor-parallel split it is loaded in."""
    name = "model.layers.0.self_attn.q_proj.weight"
    index = Path(folder) / "model.safetensors.index.json"
    file = json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"
    try:
        with safe_open(str(Path(folder) / file), framework="pt") as f:
            stored = f.get_slice(name)
            rows = stored[:FINGERPRINT_ROWS].contiguous()
            shape, dtype = stored.get_shape(), stored.get_dtype()
    except (OSError, SafetensorError, KeyError) as e:
        raise ValueError(f"cannot read {name} from {folder} to identify the model ({e})") from None
    digest = hashlib.sha256(f"{name} {dtype} {shape}".encode())
    digest.update(bytes(rows.view(torch.uint8).flatten().tolist()))
    return digest.hexdigest()[:16]


def cache_folder() -> Path:
    """$TINYFLOW_CACHE, else $XDG_CACHE_HOME/tinyflow, else ~/.cache/tinyflow."""
    if os.environ.get("TINYFLOW_CACHE"):
        return Path(os.environ["TINYFLOW_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tinyflow"


def default_path(fingerprint: str) -> Path:
    return cache_folder() / "triattention" / f"{fingerprint}.safetensors"


def path_for(folder) -> Path:
    """Where the policy looks for the statistics of the checkpoint in `folder`."""
    return default_path(fingerprint(folder))


def identity(cfg, folder) -> dict[str, str]:
    """What the statistics must agree on with the model that reads them (cfg: model.Config, the whole model's)."""
    return {"format": FORMAT, "fingerprint": fingerprint(folder), "layers": str(cfg.n_layers),
            "heads": str(cfg.n_heads), "head_dim": str(cfg.head_dim), "rope_theta": repr(float(cfg.rope_theta)),
            "rope_scaling": json.dumps(cfg.rope_scaling, sort_keys=True)}


def save(path: Path, q_mean, q_abs_mean, meta: dict[str, str]) -> Path:
    """Write statistics to path (complete or absent: through a temporary file) with what identifies the model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file({"q_mean": q_mean, "q_abs_mean": q_abs_mean}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # none is left beside the target, written or not
    return path


def random_stats(cfg, inv_freq, seed: int = 0) -> QueryStats:
    """Statistics of random values in cfg's shapes (model.Config: its layers and heads) for RoPE frequencies inv_freq
    [F], each pair's mean magnitude above the magnitude of its mean as a real one is: for timing a step on random
    weights (bench.py)."""
    gen = torch.Generator().manual_seed(seed)
    q_mean = torch.randn(cfg.n_layers, cfg.n_heads, cfg.head_dim // 2, 2, generator=gen)
    q_abs_mean = q_mean.norm(dim=-1) + torch.rand(q_mean.shape[:-1], generator=gen)
    return QueryStats(q_mean, q_abs_mean, inv_freq.float().cpu())


# ---- reading them for a model --------------------------------------------------------------------------------
def load_for(model) -> QueryStats:
    """The statistics of `model` (a model.Transformer loaded by model.load), from the cache folder by its
    fingerprint, checked against it; under tensor parallel this rank's heads. A missing file, or one made for
    another model, is refused in one line that says what to run."""
    folder = model.folder
    if folder is None:
        raise ValueError("policy triattention reads statistics of a checkpoint's queries: load the model from a "
                         "checkpoint folder or Hub id")
    want = identity(model.full_cfg, folder)
    path = default_path(want["fingerprint"])
    if not path.exists():
        raise ValueError(f"policy triattention needs this model's query statistics ({path} is missing); run: "
                         f"{CALIBRATE.format(folder)}")
    tensors, meta = read(path)
    wrong = [key for key, value in want.items() if meta.get(key) != value]
    cfg = model.full_cfg
    shape = [cfg.n_layers, cfg.n_heads, cfg.head_dim // 2]
    if wrong or list(tensors["q_mean"].shape) != shape + [2] or list(tensors["q_abs_mean"].shape) != shape:
        raise ValueError(f"{path} holds query statistics of another model ({', '.join(wrong) or 'shapes'} "
                         f"differ); run: {CALIBRATE.format(folder)}")
    heads = model.tp.part(cfg.n_heads)  # this rank's query heads
    return QueryStats(tensors["q_mean"][:, heads], tensors["q_abs_mean"][:, heads], model.inv_freq.float().cpu())


def read(path: Path) -> tuple[dict, dict]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise ValueError(f"cannot read {path} ({e}); delete it and calibrate again") from None
    if set(tensors) != {"q_mean", "q_abs_mean"}:
        raise ValueError(f"{path} is not a file of query statistics (it holds {sorted(tensors)}); delete it")
    return {k: t.float() for k, t in tensors.items()}, meta
