"""Weight-only quantization: the packed layouts, the CPU modules against the float weight they stand for (and each
row independent of the others), the Triton weight-only matmul against its reference in the interpreter, GGUF's
4-bit blocks kept exactly and the other kinds rounded to int8, and loading a model each way."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from nanospec import LLM
from nanospec.kernels.quantized_matmul import (FEW_ROWS, dequantize_ref, quantized_matmul_ref,
                                               quantized_matmul_triton)
from nanospec.model.gguf_file import read_gguf
from nanospec.model.gguf_quant import gguf_weight, int4_from_blocks
from nanospec.model.linear import Int4Linear, Int8Linear, make_linear
from nanospec.model.loader import load_checkpoint
from nanospec.model.quantization import (Int4Weight, Int8Weight, cat_rows, pack_int4, pad_rows, parse_quantization,
                                         quantize_int4, quantize_int8, select_rows)
from test_loader import llama_cpp_permute, tiny_gguf_metadata
from tiny import make_tiny_llama

torch.manual_seed(0)


# ---------------------------------------------------------------- the layouts
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_rounds_each_group_to_nearest(group_size):
    w = torch.randn(24, 256) * torch.linspace(0.1, 3, 24)[:, None]
    q = quantize_int4(w, group_size)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (24, 128) and q.scale.shape == (24, 256 // group_size)
    groups = w.view(24, -1, group_size)
    err = (q.dequantize().view(24, -1, group_size) - groups).abs()
    assert (err <= q.scale[..., None] / 2 * (1 + 1e-5)).all()  # half a step at most
    # each group's min and max are on the grid (q = 0 and q = 15)
    torch.testing.assert_close(q.dequantize().view(24, -1, group_size).amin(-1), groups.amin(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(q.dequantize().view(24, -1, group_size).amax(-1), groups.amax(-1), rtol=0, atol=1e-5)


def test_int4_packing_puts_the_even_input_in_the_low_nibble():
    q = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[0x21, 0x0F]]
    w = Int4Weight(pack_int4(q), torch.ones(1, 1), torch.zeros(1, 1), 32)
    assert w.unpacked().tolist() == q.tolist()


def test_int8_is_symmetric_per_output_channel():
    w = torch.randn(10, 70) * torch.arange(1, 11)[:, None]
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (10,)
    assert (q.q.abs().amax(dim=1) == 127).all()
    assert ((q.dequantize() - w).abs() <= q.scale[:, None] / 2 * (1 + 1e-5)).all()


def test_slicing_and_fusing_quantized_weights_match_the_float_weight():
    w = torch.randn(48, 128)
    for q in (quantize_int4(w, 32), quantize_int8(w)):
        full = q.dequantize()
        torch.testing.assert_close(q.rows(8, 24).dequantize(), full[8:24], rtol=0, atol=0)
        torch.testing.assert_close(q.columns(32, 96).dequantize(), full[:, 32:96], rtol=0, atol=0)
        index = torch.tensor([5, 0, 47])
        torch.testing.assert_close(select_rows(q, index).dequantize(), full[index], rtol=0, atol=0)
        torch.testing.assert_close(cat_rows([q, q.rows(0, 16)]).dequantize(), torch.cat([full, full[:16]]), rtol=0,
                                   atol=0)
        torch.testing.assert_close(pad_rows(q, 64).dequantize(), torch.cat([full, torch.zeros(16, 128)]), rtol=0,
                                   atol=0)
    with pytest.raises(ValueError, match="group boundaries"):
        quantize_int4(w, 32).columns(16, 64)


def test_bad_quantization_names_and_group_sizes_are_refused():
    assert parse_quantization(None) == (None, 32)
    assert parse_quantization("int4-g128") == ("int4", 128)
    with pytest.raises(ValueError, match="quantization must be one of .* got 'int3'"):
        parse_quantization("int3")
    with pytest.raises(ValueError, match="multiple of 128.*96 inputs"):
        quantize_int4(torch.randn(16, 96), 128)
    with pytest.raises(ValueError, match="group_size must be one of"):
        quantize_int4(torch.randn(16, 96), 48)


# ---------------------------------------------------------------- the CPU modules
def bf16_reference(x: torch.Tensor, q) -> torch.Tensor:
    """What the CPU kernels compute: bfloat16 x, the weight with its scales (and zeros) rounded to bfloat16."""
    if isinstance(q, Int4Weight):
        q = Int4Weight(q.packed, q.scale.bfloat16().float(), q.zero.bfloat16().float(), q.group_size)
    else:
        q = Int8Weight(q.q, q.scale.bfloat16().float())
    return x.bfloat16().float() @ q.dequantize().T


@pytest.mark.parametrize("out_features", [48, 40], ids=["tiles-of-16", "padded"])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_cpu_int4_linear_matches_its_weight(out_features, group_size, rows):
    q = quantize_int4(torch.randn(out_features, 256), group_size)
    linear = make_linear(q)
    assert isinstance(linear, Int4Linear) and linear.input_dtype == torch.bfloat16
    x = torch.randn(rows, 256)
    y = linear(x)
    assert y.shape == (rows, out_features) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), bf16_reference(x, q), rtol=2e-2, atol=2e-2)  # bf16 output rounding


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("in_features", [96, 8, 40], ids=["tiles-of-16", "padded-8", "padded-40"])
def test_cpu_int8_linear_matches_its_weight(rows, in_features):
    q = quantize_int8(torch.randn(40, in_features))
    linear = make_linear(q)
    assert isinstance(linear, Int8Linear)
    x = torch.randn(rows, in_features)
    torch.testing.assert_close(linear(x).float(), bf16_reference(x, q), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_cpu_quantized_rows_do_not_depend_on_the_batch(scheme):
    """A token's output is the same, bit for bit, alone or among others (decode, verify, a batch): what makes
    speculation over a quantized target equal plain decoding."""
    w = torch.randn(3072, 576)
    linear = make_linear(quantize_int4(w) if scheme == "int4" else quantize_int8(w))
    x = torch.randn(33, 576)
    for rows in (2, 4, 7, 16, 33):
        batch = linear(x[:rows])
        for i in range(rows):
            assert torch.equal(batch[i], linear(x[i:i + 1])[0]), (rows, i)


# ---------------------------------------------------------------- the Triton kernel (interpreted on a CPU)
# (M, N, K, group, bits, launch shape): one row, odd sizes, K crossing group and block boundaries, several K slices,
# no rows at all, the tiled (prefill) shape
KERNEL_CASES = [
    (1, 40, 96, 32, 4, None),
    (3, 24, 128, 64, 4, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, split_k=3)),
    (5, 17, 256, 128, 4, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=64, split_k=2)),
    (0, 16, 64, 32, 4, None),
    (FEW_ROWS + 3, 33, 96, 32, 4, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, split_k=1)),
    (FEW_ROWS + 1, 40, 160, 32, 4, None),  # the tiled default: two groups a tile, the last tile half empty
    (2, 24, 96, 96, 8, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, split_k=2)),
    (1, 17, 64, 64, 8, None),
]


@pytest.mark.parametrize("M,N,K,group,bits,shape", KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantized_matmul_triton_matches_reference(M, N, K, group, bits, shape, dtype, device):
    w = torch.randn(N, K)
    if bits == 4:
        q = quantize_int4(w, group)
        q, scale, zero = q.packed, q.scale, q.zero
    else:
        q = quantize_int8(w)
        q, scale, zero = q.q, q.scale, None
    q, scale = q.to(device), scale.to(device)
    zero = zero.to(device) if zero is not None else None
    x = torch.randn(M, K, device=device).to(dtype)
    y = quantized_matmul_triton(x, q, scale, zero, group, bits, shape)
    assert y.shape == (M, N) and y.dtype == dtype
    expected = quantized_matmul_ref(x, q, scale, zero, group, bits)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(y.float(), expected.float(), **tolerance)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_matmul_over_no_inputs_is_zero(bits, device):
    """K = 0: every output is an empty sum (int8's one group is then empty too)."""
    q = torch.zeros(5, 0, dtype=torch.uint8 if bits == 4 else torch.int8, device=device)
    scale = torch.zeros(5, 0, device=device) if bits == 4 else torch.ones(5, device=device)
    zero = torch.zeros(5, 0, device=device) if bits == 4 else None
    group = 32 if bits == 4 else 0
    x = torch.randn(3, 0, device=device)
    for matmul in (quantized_matmul_triton, quantized_matmul_ref):
        assert torch.equal(matmul(x, q, scale, zero, group, bits), torch.zeros(3, 5, device=device))


def test_dequantize_ref_is_the_layouts_own():
    q = quantize_int4(torch.randn(16, 64), 32)
    torch.testing.assert_close(dequantize_ref(q.packed, q.scale, q.zero, 32, 4), q.dequantize(), rtol=0, atol=0)


# ---------------------------------------------------------------- GGUF blocks
def assert_equal_to_float32_rounding(ours: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal up to a few float32 roundings of the largest term (``(q - 8) s + zero`` adds what ``q s - m`` does in
    another order)."""
    bound = 8 * torch.finfo(torch.float32).eps * (expected.abs().amax() + 1)
    assert (ours - expected).abs().amax() <= bound, what


def random_blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of ``kind`` for a ``rows x cols`` tensor: random bytes, every fp16 field a small finite number
    (gguf has no quantizer for the K kinds)."""
    block, size = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    halves = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [size - 2]}[kind]
    for offset in halves:
        data[:, offset:offset + 2] = (rng.random(len(data)) * 0.02).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_4bit_gguf_blocks_are_kept_exactly(kind):
    blocks = random_blocks(kind, 6, 512)
    weight = int4_from_blocks(blocks, kind, (6, 512))
    assert isinstance(weight, Int4Weight) and weight.group_size == 32
    assert_equal_to_float32_rounding(weight.dequantize(), torch.from_numpy(gguf.quants.dequantize(blocks, kind)))


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q5_K, Q.Q6_K])
def test_other_gguf_kinds_become_int8_per_channel(kind):
    blocks = random_blocks(kind, 6, 512)
    weight = gguf_weight(blocks, kind, (6, 512), "auto")
    assert isinstance(weight, Int8Weight)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    step = expected.abs().amax(dim=1, keepdim=True) / 127
    assert ((weight.dequantize() - expected).abs() <= step / 2 * (1 + 1e-5)).all()


def test_gguf_kinds_as_float_or_as_asked():
    blocks = random_blocks(Q.Q4_1, 4, 64)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q4_1))
    torch.testing.assert_close(gguf_weight(blocks, Q.Q4_1, (4, 64), None), expected, rtol=0, atol=0)
    assert isinstance(gguf_weight(blocks, Q.Q4_1, (4, 64), "int8"), Int8Weight)
    assert gguf_weight(blocks, Q.Q4_1, (4, 64), "int4", 64).group_size == 64
    floats = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float16)
    assert gguf_weight(floats.view(np.uint8), Q.F16, (4, 64), "auto").dtype == torch.float32


SHAPE = dict(hidden=256, ffn=512, heads=4, kv_heads=2, layers=2, vocab=64)  # K kinds: rows of 256
KINDS = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_1,
         "ffn_up": Q.Q4_0, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0}


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    """A small Llama GGUF with a mix of kinds, as llama.cpp writes them (q/k rows permuted); its float tensors by
    HF name."""
    s = SHAPE
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    metadata = tiny_gguf_metadata()
    metadata |= {"llama.block_count": s["layers"], "llama.embedding_length": s["hidden"],
                 "llama.feed_forward_length": s["ffn"], "llama.attention.head_count": s["heads"],
                 "llama.attention.head_count_kv": s["kv_heads"], "llama.vocab_size": s["vocab"]}
    for key, value in metadata.items():
        if isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    d, kv = s["hidden"] // s["heads"], s["kv_heads"] * s["hidden"] // s["heads"]
    shapes = {"attn_q": (s["hidden"], s["hidden"]), "attn_k": (kv, s["hidden"]), "attn_v": (kv, s["hidden"]),
              "attn_output": (s["hidden"], s["hidden"]), "ffn_gate": (s["ffn"], s["hidden"]),
              "ffn_up": (s["ffn"], s["hidden"]), "ffn_down": (s["hidden"], s["ffn"])}
    floats = {}
    rng = np.random.default_rng(1)

    def add(name, kind, rows, cols, permute_heads=None):
        blocks = random_blocks(kind, rows, cols, seed=len(floats))
        writer.add_tensor(name, blocks, raw_dtype=kind)
        weight = gguf.quants.dequantize(blocks, kind)
        if permute_heads:  # what llama.cpp stored is the permuted weight: the HF weight is its inverse
            weight = np.ascontiguousarray(
                weight.reshape(permute_heads, rows // permute_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols))
            assert np.array_equal(llama_cpp_permute(weight, permute_heads), gguf.quants.dequantize(blocks, kind))
        floats[name] = torch.from_numpy(weight)

    add("token_embd.weight", KINDS["token_embd"], s["vocab"], s["hidden"])
    for i in range(s["layers"]):
        for part, (rows, cols) in shapes.items():
            heads = {"attn_q": s["heads"], "attn_k": s["kv_heads"]}.get(part)
            add(f"blk.{i}.{part}.weight", KINDS[part], rows, cols, heads)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(s["hidden"])).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(s["hidden"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert d == 64
    return path, floats


def test_gguf_file_keeps_its_4bit_tensors(quantized_gguf):
    path, floats = quantized_gguf
    model = read_gguf(path, "auto")
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for gguf_name, expected in floats.items():
        part = gguf_name.split(".")[-2]
        hf = "model.embed_tokens.weight" if part == "token_embd" else \
            f"model.layers.{gguf_name.split('.')[1]}.{names[part]}.weight"
        weight = model.tensors[hf]
        if KINDS[part] in (Q.Q4_0, Q.Q4_1, Q.Q4_K):
            assert isinstance(weight, Int4Weight), hf
            assert_equal_to_float32_rounding(weight.dequantize(), expected, hf)
        else:
            assert isinstance(weight, Int8Weight), hf
            step = expected.abs().amax(dim=1, keepdim=True) / 127
            assert ((weight.dequantize() - expected).abs() <= step / 2 * (1 + 1e-5)).all(), hf
    assert model.tensors["model.norm.weight"].dtype == torch.float32


def test_gguf_model_runs_quantized_like_its_dequantized_twin(quantized_gguf):
    """The int4/int8 model and the float32 model of the very weights those stand for give the same logits, up to the
    bfloat16 rounding of the CPU kernels' activations. (On CUDA, "auto" loads float weights: this is the CPU's.)"""
    path, _ = quantized_gguf
    quantized = LLM(str(path), quantization="auto", num_blocks=64, block_size=4, device="cpu")
    assert quantized.model.quantization == "int4-g32 (6), int8 (3)"
    twin = load_checkpoint(path, torch.float32, "auto")
    twin.tensors = {name: w if isinstance(w, torch.Tensor) else w.dequantize() for name, w in twin.tensors.items()}
    floating = LLM(twin, quantization=None, num_blocks=64, block_size=4, device="cpu")
    from tiny import forward_logits

    ids = [5, 9, 33, 12, 40, 7]
    ours, expected = forward_logits(quantized, ids), forward_logits(floating, ids)
    # bfloat16 keeps 8 bits: a few roundings per layer stay within 2% of the logits' scale; a weight in the wrong
    # layout (rows unpermuted, nibbles swapped) is off by the scale itself
    assert (ours - expected).abs().amax() <= 0.02 * expected.abs().amax()


def test_hf_checkpoint_is_quantized_on_load(tmp_path):
    make_tiny_llama(tmp_path, seed=3, layers=2, ffn=128)
    for quantization, kind in [("int4", "int4-g32"), ("int4-g64", "int4-g64"), ("int8", "int8")]:
        llm = LLM(str(tmp_path), quantization=quantization, num_blocks=64, block_size=4)
        assert llm.model.quantization == f"{kind} (9)"
    as_stored = LLM(str(tmp_path), num_blocks=64, block_size=4, dtype="float32")  # auto: as stored
    assert as_stored.model.quantization == "float32 (9)"
    with pytest.raises(ValueError, match="multiple of 128.*64 inputs"):
        LLM(str(tmp_path), quantization="int4-g128", num_blocks=64, block_size=4)


def test_embedded_model_loads_4bit_by_default():
    checkpoint = load_checkpoint(None, torch.float32, "auto")
    kinds = {type(w).__name__ for name, w in checkpoint.tensors.items() if "proj" in name}
    assert kinds == {"Int4Weight"}
    assert isinstance(checkpoint.tensors["model.embed_tokens.weight"], Int8Weight)  # Q8_0 in the file


def test_auto_quantization_on_cuda_loads_float_weights(tmp_path, monkeypatch):
    """On CUDA, "auto" keeps float weights: bf16 cuBLAS outruns the Triton int4 matmul there (docs/quantization.md);
    int4 stays one argument away, for a draft too. (The device is stubbed: the choice needs no GPU.)"""
    import nanospec.engine_args as engine_args

    make_tiny_llama(tmp_path, seed=3, layers=2, ffn=128)
    draft = {"method": "draft", "model": str(tmp_path), "num_speculative_tokens": 2}
    assert engine_args.EngineArgs(model=str(tmp_path), device="cpu").quantization == "auto"
    monkeypatch.setattr(engine_args, "resolve_device", lambda device: torch.device("cuda"))
    args = engine_args.EngineArgs(model=str(tmp_path), speculative_config=draft)
    assert args.device.type == "cuda" and args.quantization is None and args.speculative.quantization is None
    assert engine_args.EngineArgs(model=str(tmp_path), quantization="int4").quantization == "int4"


@pytest.mark.parametrize("quantization,kind", [("int4", "int4-g32 (5)"), ("int8", "int8 (5)"), (None, "float32 (5)")])
def test_random_weights_are_rounded_as_asked(quantization, kind):
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    llm = LLM.with_random_weights(shape, device="cpu", quantization=quantization)
    assert llm.stats()["quantization"] == kind
