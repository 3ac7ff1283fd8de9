"""FP8 weights (fp8.py): checkpoints in the FP8 block format, written here from the tiny checkpoints, load and give
the logits of their dequantized weights (transformers on those, the oracle); a 16-bit checkpoint quantized at load
holds exactly what such a checkpoint holds; both kernels equal their reference (the Triton interpreter on the CPU);
a bad FP8 checkpoint is one line."""
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import fp8
import tinyflow
from cache import KVCache
from model import load
from conftest import FORMAT, edit_json, write_fp8_checkpoint
from test_bad_input import one_line_error, update
from test_generate import cli

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def fp8_checkpoints(checkpoints, tmp_path_factory):
    """Per architecture: (the FP8 checkpoint, its weights dequantized into a float32 checkpoint)."""
    root = tmp_path_factory.mktemp("fp8")
    return {arch: (write_fp8_checkpoint(folder, root / arch, root / f"{arch}-values"), root / f"{arch}-values")
            for arch, folder in checkpoints.items()}


def quantize_linear_inputs(model):
    """transformers' model with what its layers' linears read quantized first, per token and 128 columns, as the
    FP8 tensor cores read it (fp8.quantize_rows, written out: value * factor); every input, one row too (the
    tests give it prompts of many)."""
    def quantized(module, args, kwargs):
        x = args[0] if args else kwargs.pop("input")
        values, scale = fp8.quantize_rows(x.reshape(-1, x.shape[-1]))
        x_used = (values.float().view(*scale.shape, fp8.BLOCK) * scale[..., None]).flatten(1)[:, :x.shape[-1]]
        return (x_used.view(x.shape).to(x.dtype),), kwargs
    for name, module in model.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            module.register_forward_pre_hook(quantized, with_kwargs=True)
    return model


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_an_fp8_checkpoint_gives_the_logits_of_its_dequantized_weights_and_quantized_activations(fp8_checkpoints,
                                                                                                 arch):
    """Its q/k/v and gate/up parts fused with their own blocks (k and v: 64 rows, half a block each). A prompt is
    many rows, so its activations are quantized too (the GPU's tensor cores; the CPU runs the same math), and
    transformers' linears read them quantized the same way."""
    folder, values = fp8_checkpoints[arch]
    model, tok = load(str(folder), torch.device("cpu"), torch.float32)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, fp8.Fp8Linear)
    tokens = torch.randint(0, 320, (2, 30), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.cfg, 2, 32, "cpu", torch.float32)
    logits = model(tokens, torch.arange(30).expand(2, 30), cache, rows=torch.arange(2))
    reference = transformers.AutoModelForCausalLM.from_pretrained(values, dtype=torch.float32).eval()
    expected = quantize_linear_inputs(reference)(tokens).logits
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0)  # float32 in another order, as test_model.py


def test_weights_fp8_quantizes_a_16_bit_checkpoint_into_the_blocks_an_fp8_checkpoint_holds(checkpoints, tmp_path):
    """--weights fp8 / LLM(weights="fp8"): the very e4m3 values and factors of a checkpoint written in the format
    (with fp32 factors, which fp8.py keeps)."""
    folder = write_fp8_checkpoint(checkpoints["llama"], tmp_path / "fp8", tmp_path / "values", torch.float32)
    quantized, _ = load(str(checkpoints["llama"]), torch.device("cpu"), torch.float32, weights="fp8")
    stored, _ = load(str(folder), torch.device("cpu"), torch.float32)
    for (name, a), (_, b) in zip(quantized.named_parameters(), stored.named_parameters()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == fp8.FP8 else torch.equal(a, b), name


@pytest.mark.parametrize("arch", ["qwen3", "llama"], ids=["tied-head", "own-head"])
def test_weights_fp8_all_quantizes_the_lm_head_too_and_a_tied_embedding_stays_as_stored(checkpoints, arch):
    """--weights fp8-all: the layers as fp8 quantizes them, and the head in blocks of its own (a tied one: the
    embedding's rows, quantized into a copy); the logits are those of the dequantized head."""
    folder = str(checkpoints[arch])
    layers, _ = load(folder, torch.device("cpu"), torch.float32, weights="fp8")
    both, _ = load(folder, torch.device("cpu"), torch.float32, weights="fp8-all")
    assert fp8.weights_of(layers) == "fp8" and fp8.weights_of(both) == "fp8-all"
    stored_head = layers.model.embed_tokens.weight if arch == "qwen3" else layers.lm_head.weight
    assert layers.embedding_is_head == (arch == "qwen3") and not both.embedding_is_head
    values, scale = fp8.quantize_blocks(stored_head)
    assert torch.equal(both.lm_head.weight.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(both.lm_head.weight_scale_inv, scale)
    assert torch.equal(both.model.embed_tokens.weight, layers.model.embed_tokens.weight)
    x = torch.randn(3, stored_head.shape[1], generator=torch.Generator().manual_seed(0))  # 3 rows: quantized x
    head = both.lm_head
    assert torch.equal(both.head(x), fp8.linear_ref(x, head.weight, head.weight_scale_inv, head.row_block, True))


def test_quantizing_a_quantized_model_again_leaves_its_blocks_as_they_are(checkpoints):
    """fp8 then fp8-all quantizes the head alone; the layers' blocks (and a head's, quantized twice) stay bit for
    bit: quantizing e4m3 values again would give them factors near 1, outputs ~10^4 too large."""
    folder = str(checkpoints["qwen2"])
    once, _ = load(folder, torch.device("cpu"), torch.float32, weights="fp8-all")
    twice = fp8.quantize(fp8.quantize(load(folder, torch.device("cpu"), torch.float32, weights="fp8")[0], "fp8-all"),
                         "fp8-all")
    for (name, a), (_, b) in zip(once.named_parameters(), twice.named_parameters(), strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype == fp8.FP8 else a,
                           b.view(torch.uint8) if b.dtype == fp8.FP8 else b), name


def test_fp8_weights_generate_from_prompts_and_score_with_a_budget(checkpoints):
    llm = tinyflow.LLM(str(checkpoints["qwen3"]), budget=36, device="cpu", compile=False, weights="fp8")
    outs = llm.generate(["Hello world", "The quick brown fox"], max_new_tokens=40)
    assert [len(o.token_ids) for o in outs] == [40, 40]
    full = tinyflow.LLM(str(checkpoints["qwen3"]), device="cpu", compile=False)
    exact, quantized = full.score(["Hello world"], [" hello tinyflow"])[0], llm.score(["Hello world"], [" hello tinyflow"])[0]
    assert exact.token_ids == quantized.token_ids and exact.logprobs != quantized.logprobs


# ---- the kernels against their reference -------------------------------------------------------------------
def quantized_linear(N, K, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data = torch.randn(N, K, generator=g) * torch.logspace(-2, 1, N)[:, None]  # rows of other sizes
    layer = fp8.Fp8Linear.of(linear, sizes)
    return [t.to(DEVICE) for t in (layer.weight, layer.weight_scale_inv, layer.row_block)]


def on_the_e4m3_grid(M, K, seed) -> torch.Tensor:
    """Activations each token's 128 columns of which quantize exactly: e4m3 values, the largest |value| 448, times a
    power of two. Triton's interpreter rounds fp32 to e4m3 wrongly (7.9 -> 4.0; values already on the grid
    convert exactly), so on the CPU the tensor-core kernel's own quantization is given nothing to round."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * 64).clamp(-448, 448).to(fp8.FP8).float()
    x[:, ::128] = 448 * torch.randn(M, x[:, ::128].shape[1], generator=g).sign()
    powers = torch.randint(-8, 4, (M, -(-K // 128)), generator=g).repeat_interleave(128, dim=1)[:, :K]
    return x * 2.0 ** powers


@pytest.mark.parametrize("M", [1, 3, 17, 70])
@pytest.mark.parametrize("N, K, sizes", [(200, 300, [64, 64, 72]), (256, 512, [256]), (320, 200, [192, 128])],
                         ids=["fused-partial-blocks", "whole-blocks", "fused-192-128"])
def test_both_kernels_equal_their_reference(M, N, K, sizes):
    """Weight-only (fp32 products of the e4m3 weights) and tensor-core (activations quantized per token and 128
    columns by a kernel of their own): the reference's float32 products summed in another order, so to float32 rounding
    of the largest output on the CPU (1e-6 of it); on a GPU in bf16, to bf16's (the kernels round once at the end,
    the reference's dequantized weight once more)."""
    weight, scale, rows = quantized_linear(N, K, sizes)
    if CUDA:
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    else:
        x = on_the_e4m3_grid(M, K, seed=1)
    # each kernel with K split over programs (the default's waves) and not split (waves=0); the weight-only one,
    # a program per row, at one row in each launch (the engine runs it there) and at 3 as launched (17 cost the
    # interpreter 35 s)
    kernels = [("weight_only", {}), ("weight_only", {"waves": 0}), ("weight_only", {"groups": 1}),
               ("weight_only", {"groups": 4}),
               ("tensor_cores", {}), ("tensor_cores", {"waves": 0})][0 if M == 1 else 4:]
    kernels += [("weight_only", {})] if M == 3 else []
    kernels += [("cublas", {})] if fp8._cublas_reads(x, weight, scale) else []  # CUDA, whole blocks
    for name, launch in kernels:
        want = fp8.linear_ref(x.float(), weight, scale, rows, quantized_x=name != "weight_only")
        got = fp8.fp8_linear(x, weight, scale, rows, name, **launch).float()
        tol = dict(atol=2e-2 * want.abs().max().item(), rtol=2e-2) if CUDA else dict(atol=1e-6 * want.abs().max().item(), rtol=0)
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("name", ["weight_only", "tensor_cores"])
def test_a_kernel_that_splits_k_leaves_its_arrival_counts_at_zero_for_the_next_launch(name):
    """The split that arrives last adds the splits' sums and sets its count back to zero (fp8._arrivals: one buffer
    for every launch, never cleared in between): a second launch then adds its own splits, bit for bit the first's
    sums, and a launch of another grid over the same counts is right too. (3 rows and 512 columns: both kernels
    split K at both grids; without the reset the second launch fails.)"""
    weight, scale, rows = quantized_linear(256, 512, [256])
    x = on_the_e4m3_grid(3, 512, seed=2).to(DEVICE, torch.bfloat16 if CUDA else torch.float32)
    first = fp8.fp8_linear(x, weight, scale, rows, name)
    assert torch.equal(fp8.fp8_linear(x, weight, scale, rows, name), first)
    assert not fp8._arrivals(x.device).any()
    block_n = {"weight_only": fp8.WEIGHT_ONLY_LAUNCH, "tensor_cores": fp8.TENSOR_CORE_LAUNCH}[name]["block_n"]
    wide = fp8.fp8_linear(x, weight, scale, rows, name, block_n=2 * block_n)  # half the programs
    # the same splits, but wider tiles: a tensor-core product may add within them in another order, so to bf16's
    # rounding on a GPU and fp32's on the CPU (as test_both_kernels_equal_their_reference)
    tol = 2e-2 if CUDA else 1e-6
    torch.testing.assert_close(wide.float(), first.float(), atol=tol * first.abs().max().item(), rtol=tol)
    assert not fp8._arrivals(x.device).any()


def recording_kernels(monkeypatch) -> list:
    """fp8.py's three launchers, each noting (its name, its rows) in the list returned before it runs."""
    ran = []

    def recording(name, kernel):
        def launch(x, *args, **kwargs):
            ran.append((name, len(x)))
            return kernel(x, *args, **kwargs)
        return launch
    for name in ("_weight_only", "_tensor_cores", "_cublas"):
        monkeypatch.setattr(fp8, name, recording(name, getattr(fp8, name)))
    return ran


@pytest.mark.parametrize("K", [256, 512], ids=["K-256", "K-512"])
def test_the_op_runs_weight_only_up_to_its_rows_then_the_tensor_cores_through_cublas_where_it_reads_the_blocks(
        monkeypatch, K):
    """cuBLAS's blockwise product (torch._scaled_mm) from CUBLAS_ROWS rows on a Hopper GPU when K is a multiple of
    512 (its factors come in fours); else Triton's."""
    weight, scale, rows = quantized_linear(256, K, [256])
    dtype = torch.bfloat16 if CUDA else torch.float32
    x = torch.randn(fp8.CUBLAS_ROWS, K).to(DEVICE, dtype)
    cublas = fp8._cublas_reads(x, weight, scale)  # on a GPU, probed first: the probe runs _cublas
    ran = recording_kernels(monkeypatch)

    def expected(M):
        if M <= fp8.WEIGHT_ONLY_ROWS:
            return "_weight_only"
        return "_cublas" if M >= fp8.CUBLAS_ROWS and cublas else "_tensor_cores"
    counts = (1, fp8.WEIGHT_ONLY_ROWS, fp8.WEIGHT_ONLY_ROWS + 1, fp8.CUBLAS_ROWS, 70)
    for M in counts:
        fp8.fp8_linear(torch.randn(M, K).to(DEVICE, dtype), weight, scale, rows)
    assert ran == [(expected(M), M) for M in counts]


def test_more_rows_than_max_rows_are_multiplied_in_parts_all_with_quantized_activations(monkeypatch):
    """A long prefill in parts of MAX_ROWS (the kernels' int32 offsets): a last part of one row still goes to the
    tensor cores, as the CPU's reference assumes, not to the weight-only kernel."""
    weight, scale, rows = quantized_linear(256, 256, [256])
    ran = recording_kernels(monkeypatch)
    monkeypatch.setattr(fp8, "MAX_ROWS", 4)
    x = on_the_e4m3_grid(5, 256, seed=4).to(DEVICE)
    got = fp8.fp8_linear(x, weight, scale, rows)
    assert ran == [("_tensor_cores", 4), ("_tensor_cores", 1)]
    want = fp8.linear_ref(x, weight, scale, rows, quantized_x=True)
    torch.testing.assert_close(got, want, atol=1e-6 * want.abs().max().item(), rtol=0)  # float32, another order


@pytest.mark.parametrize("M", [1, 3, 64])
def test_a_weight_of_no_rows_gives_no_columns(M):
    """A tensor-parallel rank's FP8 head over a vocabulary smaller than 128 x (ranks - 1) has no rows: no kernel
    runs (on a Hopper GPU, 64 rows would go to cuBLAS, not asked for an empty product)."""
    weight, scale = torch.empty(0, 256, dtype=fp8.FP8, device=DEVICE), torch.empty(0, 2, device=DEVICE)
    got = fp8.fp8_linear(torch.randn(M, 256, device=DEVICE), weight, scale, torch.empty(0, dtype=torch.long,
                                                                                       device=DEVICE))
    assert got.shape == (M, 0)


def test_on_the_cpu_a_layer_runs_the_reference_of_the_kernel_a_gpu_would_pick():
    """Up to WEIGHT_ONLY_ROWS rows the activations as they are, above them quantized (the tensor cores' input)."""
    linear = torch.nn.Linear(256, 128, bias=False)
    layer = fp8.Fp8Linear.of(linear)
    for M in {max(1, fp8.WEIGHT_ONLY_ROWS), fp8.WEIGHT_ONLY_ROWS + 1}:  # WEIGHT_ONLY_ROWS 0: tensor cores only
        x = torch.randn(M, 256, generator=torch.Generator().manual_seed(M))
        refs = {quantized: fp8.linear_ref(x, layer.weight, layer.weight_scale_inv, layer.row_block, quantized)
                for quantized in (False, True)}
        assert not torch.equal(refs[False], refs[True])
        assert torch.equal(layer(x), refs[M > fp8.WEIGHT_ONLY_ROWS])


def test_the_quantize_kernel_equals_quantize_rows_and_pads_rows_for_cublas():
    """The tensor cores' activations, quantized by _quantize_kernel: quantize_rows' very e4m3 values and factors
    (the factors transposed, [KB, M], as cuBLAS reads them), the last block's 56 padding columns 0; the rows
    cuBLAS is given beyond M (to a multiple of 16) 0, with the factor 1. On the CPU the activations lie on the e4m3
    grid (on_the_e4m3_grid says why); on a GPU they are any."""
    M, K = 70, 200
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(3)) * 3 if CUDA else on_the_e4m3_grid(M, K, 3)
    values, scales = fp8._quantized(x.to(DEVICE), rows_multiple=16)
    want_values, want_scales = fp8.quantize_rows(x.to(DEVICE))
    assert values.shape == (80, 256) and scales.shape == (2, 80)
    assert torch.equal(scales.t()[:M], want_scales) and scales[:, M:].eq(1).all()
    assert torch.equal(values[:M].view(torch.uint8), want_values.view(torch.uint8))
    assert values[M:].view(torch.uint8).eq(0).all()


def test_activations_are_quantized_per_token_and_128_columns():
    """The tensor cores' input: each token's 128 columns (the last 72 of 200 padded with zeros) divided by their
    factor, their largest |value| times 1/448 (so the largest goes to e4m3's 448, to an ulp), rounded to e4m3."""
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    values, scale = fp8.quantize_rows(x)
    for m in range(3):
        for j, cols in enumerate((slice(0, 128), slice(128, 200))):
            factor = x[m, cols].abs().max() * (1 / 448)
            assert scale[m, j] == factor
            assert torch.equal(values[m, cols].float(), (x[m, cols] / factor).to(torch.float8_e4m3fn).float())
    assert values.shape == (3, 256) and values[:, 200:].float().eq(0).all()


def test_a_block_of_zeros_quantizes_to_zeros_with_a_factor_of_one():
    values, scale = fp8.quantize_blocks(torch.cat([torch.zeros(128, 128), torch.ones(128, 128)], 1))
    assert scale.tolist() == [[1.0, torch.tensor(1 / 448).item()]]  # the factor in fp32
    assert values.float().tolist() == [[0.0] * 128 + [448.0] * 128] * 128


# ---- refusals -------------------------------------------------------------------------------------------------
def damaged(fp8_checkpoints, tmp_path, damage):
    folder = tmp_path / "damaged"
    shutil.copytree(fp8_checkpoints["qwen2"][0], folder)
    damage(folder)
    return folder


def edit_weights(folder, edit):
    weights = load_file(folder / "model.safetensors")
    edit(weights)
    save_file(weights, folder / "model.safetensors")


FACTOR = "model.layers.0.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize("damage, message", [
    (lambda f: edit_weights(f, lambda w: w.pop(FACTOR)), f"checkpoint is missing 1 weight(s), e.g. {FACTOR!r}"),
    (lambda f: edit_weights(f, lambda w: w.update({FACTOR: torch.ones(2, 1)})),
     f"weight {FACTOR!r} has shape [2, 1], the config implies [1, 1]"),
    (lambda f: edit_json(f, "config.json", update(quantization_config={**FORMAT, "weight_block_size": [64, 64]})),
     "quantization_config has weight_block_size [64, 64]; tinyflow loads 16-bit checkpoints and FP8 block ones"),
    (lambda f: edit_json(f, "config.json", update(quantization_config={"quant_method": "awq", "bits": 4})),
     "quantization_config has quant_method 'awq'; tinyflow loads 16-bit checkpoints and FP8 block ones"),
    (lambda f: edit_json(f, "config.json", update(quantization_config={**FORMAT, "activation_scheme": "static"})),
     "quantization_config has activation_scheme 'static'"),
    (lambda f: edit_json(f, "config.json", lambda c: {k: v for k, v in c.items() if k != "quantization_config"}),
     "weight_scale_inv) but config.json has no quantization_config: restore the checkpoint's config.json"),
    (lambda f: edit_weights(f, lambda w: w.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)})),
     "weight 'model.layers.0.mlp.up_proj.weight' of model.safetensors is stored as torch.float32, but config.json's "
     "quantization_config says FP8 blocks"),
], ids=["missing-factor", "factor-shape", "block-size", "other-method", "static-activations", "no-config",
        "16-bit-weight"])
def test_a_bad_fp8_checkpoint_is_one_line(fp8_checkpoints, tmp_path, capsys, damage, message):
    folder = damaged(fp8_checkpoints, tmp_path, damage)
    one_line_error(*cli(capsys, "--model", folder, "--prompt", "Hi", "--no-compile")[::2], message)


def test_a_tensor_parallel_split_that_cuts_the_blocks_is_refused():
    from model import Config
    from parallel import Group
    cfg = Config.from_dict(dict(model_type="qwen3", vocab_size=512, hidden_size=1024, intermediate_size=3072,
                                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=128))
    fp8.check_split(cfg, Group(0, 2))  # k/v: 256 rows, 128 a rank; MLP: 1536 a rank
    with pytest.raises(ValueError, match="FP8 weights split over 4 ranks: k_proj's and v_proj's rows, 256 in all, "
                                         "would be 64 a rank, which cuts their 128 x 128 blocks; run with fewer ranks"):
        fp8.check_split(cfg, Group(0, 4))


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("policy", ["longflow", "rkv"])
def test_fp8_weights_in_the_compiled_graph_replayed_step_equal_eager_and_never_recompile(checkpoints, policy):
    """The kernels inside the compiled step, replayed as CUDA graphs at both sizes of the ladder (three prompts on
    two rows), give the tokens of the same model run eagerly (fp32 activations: exact products)."""
    from generate import Engine
    model, tok = load(str(checkpoints["llama"]), torch.device("cuda"), torch.float32, weights="fp8")
    prompts = [tok.encode("Hello world"), tok.encode("The quick brown fox jumps"), tok.encode("Hello")]
    eager, _ = Engine(model, compile=False).generate(prompts, 80, [], 53, policy, batch_size=2)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        graphed, _ = Engine(model).generate(prompts, 80, [], 53, policy, batch_size=2)
    assert graphed == eager
