"""Paged attention (reference and Triton kernel) against a dense per-query reference; mask helpers.

The attention tests run on the ``device`` fixture's device (the Triton kernel compiled on CUDA, interpreted on the
CPU); the dense oracle always runs on the CPU in float64. The mask helpers are host-side code (the engine builds
masks on the CPU and then moves them), tested on the CPU."""

import math
import random

import pytest
import torch

from nanospec.kernels.attention_mask import causal_mask, concat_masks, pack_mask, unpack_mask
from nanospec.kernels.backend import backend
from nanospec.kernels.cpu_attention import PagedAttentionPlan
from nanospec.kernels.paged_attention import paged_attention, paged_attention_ref
from nanospec.speculative.proposal import tree_depths, tree_mask


# ----------------------------------------------------------------------------------------------
# Mask helpers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 63, 64, 65, 130])
def test_pack_unpack_roundtrip(n):
    dense = torch.rand(n, n, generator=torch.Generator().manual_seed(n)) < 0.5
    words = pack_mask(dense)
    assert words.dtype == torch.int64 and words.shape == (n, math.ceil(n / 64))
    assert torch.equal(unpack_mask(words, n), dense)


def test_bit_63_is_the_sign_bit():
    dense = torch.zeros(2, 130, dtype=torch.bool)
    dense[0, 63] = True
    dense[1, 127] = True
    dense[1, 129] = True
    words = pack_mask(dense)
    assert words[0].tolist() == [-(2**63), 0, 0]
    assert words[1].tolist() == [0, -(2**63), 2]
    assert torch.equal(unpack_mask(words, 130), dense)


@pytest.mark.parametrize("q_len", [1, 7, 64, 65, 130])
def test_causal_mask(q_len):
    dense = unpack_mask(causal_mask(q_len), q_len)
    assert torch.equal(dense, torch.ones(q_len, q_len, dtype=torch.bool).tril())


def test_tree_mask_and_depths():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = [-1, 0, 0, 1, 1, 2]
    dense = unpack_mask(tree_mask(parents), 6)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}}
    for node, seen in expected.items():
        assert set(torch.nonzero(dense[node]).flatten().tolist()) == seen
    assert tree_depths(parents) == [0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError):
        tree_mask([-1, 2, 0])


def test_concat_masks_pads_words():
    masks = [causal_mask(3), causal_mask(70), causal_mask(0)]
    combined = concat_masks(masks)
    assert combined.shape == (73, 2)
    assert torch.equal(combined[:3, 0], masks[0][:, 0]) and torch.all(combined[:3, 1] == 0)
    assert torch.equal(combined[3:], masks[1])
    assert concat_masks([]).shape == (0, 0)


# ----------------------------------------------------------------------------------------------
# Paged attention
# ----------------------------------------------------------------------------------------------


def make_batch(q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, device, dtype=torch.float32,
               index_dtype=torch.int32, seed=0):
    """Random q and a paged K/V cache whose blocks are scattered (and padded with unused blocks), every tensor on
    ``device`` (drawn on the CPU first, so the values are the same on every device)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1
    block_tables = torch.full((len(q_lens), max_blocks), -1, dtype=index_dtype)
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = torch.tensor(physical[:n], dtype=index_dtype)
        physical = physical[n:]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return dict(
        q=q.to(device), k_cache=k_cache.to(device), v_cache=v_cache.to(device), block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=index_dtype, device=device), query_start_loc=query_start_loc.to(device),
        scale=1.0 / math.sqrt(head_dim), max_query_len=max(q_lens, default=0),
    )


def dense_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len,
                    tree_mask=None):
    """Obviously correct: for each query token and head, list the visible keys, explicit softmax in float64, on the
    CPU (whatever device the batch is on)."""
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc = (
        t.cpu() for t in (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc))
    tree_mask = tree_mask.cpu() if tree_mask is not None else None
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    for s in range(len(seq_lens)):
        q_start, q_end = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len = q_end - q_start
        ctx_len = int(seq_lens[s]) - q_len
        for i in range(q_len):
            visible = []
            for j in range(int(seq_lens[s])):
                b = j - ctx_len
                if j < ctx_len:
                    visible.append(j)
                elif tree_mask is None and b <= i:
                    visible.append(j)
                elif tree_mask is not None and (int(tree_mask[q_start + i, b // 64]) >> (b % 64)) & 1:
                    visible.append(j)
            slots = [int(block_tables[s, j // block_size]) * block_size + j % block_size for j in visible]
            for h in range(num_q_heads):
                kv = h // group
                k = k_cache.reshape(-1, num_kv_heads, head_dim)[slots, kv].double()
                v = v_cache.reshape(-1, num_kv_heads, head_dim)[slots, kv].double()
                logits = scale * (k @ q[q_start + i, h].double())
                weights = torch.exp(logits - logits.max())
                weights = weights / weights.sum()
                out[q_start + i, h] = weights @ v
    return out


def run(impl, batch, tree_mask=None):
    """``impl`` ("ref": the torch reference; "cpu": the CPU backend; "triton": the kernel) on the batch (and mask)
    as given."""
    if impl == "ref":
        return paged_attention_ref(**batch, tree_mask=tree_mask)
    if impl == "cpu":  # the CPU backend through a one-layer plan
        q, k_cache, v_cache = batch["q"], batch["k_cache"], batch["v_cache"]
        plan = PagedAttentionPlan(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"],
                                  k_cache.shape[1], q.shape[1] // k_cache.shape[2], tree_mask)
        return plan.attend(q * batch["scale"], k_cache.flatten(0, 1), v_cache.flatten(0, 1))
    with backend("triton"):
        return paged_attention(**batch, tree_mask=tree_mask)


def check(impl, batch, tree_mask=None, atol=1e-4):
    """``impl`` on the batch's device against the float64 oracle. The default 1e-4 is fp32's, on either device: both
    backends compute in fp32 (the Triton dots with input_precision="ieee", the reference's matmuls without TF32)."""
    out = run(impl, batch, tree_mask)
    assert out.shape == batch["q"].shape and out.dtype == batch["q"].dtype
    assert out.device == batch["q"].device
    expected = dense_attention(**batch, tree_mask=tree_mask)
    torch.testing.assert_close(out.cpu().double(), expected, atol=atol, rtol=atol)


IMPLS = ["ref", "cpu", "triton"]


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill(device, impl):
    check(impl, make_batch([7, 20], [0, 0], num_q_heads=4, num_kv_heads=4, head_dim=32, block_size=16,
                           device=device))


@pytest.mark.parametrize("impl", IMPLS)
def test_decode(device, impl):
    check(impl, make_batch([1, 1, 1], [0, 15, 40], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                           device=device))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_mixed_ragged_batch(device, impl, block_size, index_dtype):
    batch = make_batch([1, 5, 17], [33, 16, 3], num_q_heads=6, num_kv_heads=2, head_dim=64,
                       block_size=block_size, device=device, index_dtype=index_dtype)
    check(impl, batch)


@pytest.mark.parametrize("impl", IMPLS)
def test_decodes_batched_beside_a_prefill(device, impl):
    # the reference batches the single-query sequences into one call and loops over the rest
    check(impl, make_batch([1, 9, 1, 1], [37, 0, 2, 16], num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4,
                           device=device))


@pytest.mark.parametrize("impl", IMPLS)
def test_long_prefill_spans_query_and_key_tiles(device, impl):
    # 70 queries x 3 heads per kv head -> several query blocks; 80 keys -> two key tiles.
    check(impl, make_batch([70], [10], num_q_heads=3, num_kv_heads=1, head_dim=32, block_size=16, device=device))


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_length_query_in_batch(device, impl):
    check(impl, make_batch([3, 0, 2], [5, 9, 0], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4,
                           device=device))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batch(device, impl):
    for q_lens in ([], [0, 0]):
        batch = make_batch(q_lens, [4] * len(q_lens), num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4,
                           device=device)
        assert run(impl, batch).shape == (0, 4, 32)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_query(device, impl):
    """q as a view into a fused qkv projection output (token stride larger than Hq * D)."""
    batch = make_batch([2, 4], [6, 0], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4, device=device)
    qkv = torch.randn(6, 8, 32, device=device)
    qkv[:, :4] = batch["q"]
    batch["q"] = qkv[:, :4]
    check(impl, batch)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(device, impl, dtype):
    """Half-precision inputs and output. The tolerances are the output's rounding to the half type (2^-9 relative
    for bf16, 2^-12 for fp16) plus, on CUDA, the Triton kernel's feeding of the softmax weights to the tensor cores
    in that type (the interpreter upcasts to fp32 instead): at most 2^-9 (2^-12) of max |v| ~ 4 here, so under
    1e-2 (1e-3), within 2e-2 (2e-3). The reference computes its scores and weights in the half type too."""
    batch = make_batch([1, 6], [20, 9], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, device=device,
                       dtype=dtype)
    check(impl, batch, atol=2e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("impl", IMPLS)
def test_random_trees(device, impl):
    rng = random.Random(0)
    q_lens = [1, 6, 13]
    masks = [tree_mask([-1] + [rng.randrange(i) for i in range(1, n)]) for n in q_lens]
    batch = make_batch(q_lens, [9, 0, 21], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=4, device=device)
    check(impl, batch, tree_mask=concat_masks(masks).to(device))


@pytest.mark.parametrize("impl", IMPLS)
def test_dense_random_masks_beyond_one_word(device, impl):
    """Lookahead-like masks: arbitrary rows (each sees itself), 70 new tokens -> two words per row."""
    gen = torch.Generator().manual_seed(1)
    q_lens = [70, 4]
    dense = [(torch.rand(n, n, generator=gen) < 0.3) | torch.eye(n, dtype=torch.bool) for n in q_lens]
    batch = make_batch(q_lens, [5, 30], num_q_heads=2, num_kv_heads=1, head_dim=32, block_size=16, device=device)
    check(impl, batch, tree_mask=concat_masks([pack_mask(d) for d in dense]).to(device))


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_bitmask_equals_no_mask(device, impl):
    q_lens = [3, 1, 9]
    batch = make_batch(q_lens, [12, 7, 0], num_q_heads=4, num_kv_heads=1, head_dim=32, block_size=4, device=device)
    with_mask = run(impl, batch, tree_mask=concat_masks([causal_mask(n) for n in q_lens]).to(device))
    # 1e-5 on either device: the two runs differ only in where the kernel's key loop stops (with a mask it also
    # visits the later tiles, whose keys are all masked: weights exactly 0), so they agree to fp32 rounding or better
    torch.testing.assert_close(with_mask, run(impl, batch), atol=1e-5, rtol=1e-5)


def test_plan_reads_consecutive_blocks_as_a_slice(device):
    """A sequence whose blocks are consecutive (a lone request's are) is read as a slice, not gathered:
    same result as the dense reference, for a decode, a causal prefill and a tree."""
    q_lens, ctx_lens, block_size = [1, 7, 5], [22, 3, 9], 4
    batch = make_batch(q_lens, ctx_lens, num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=block_size,
                       device=device)
    tables = torch.full_like(batch["block_tables"], -1)
    first = 0
    for s, n in enumerate(batch["seq_lens"].tolist()):
        num_blocks = math.ceil(n / block_size)
        tables[s, :num_blocks] = torch.arange(first, first + num_blocks, device=device)
        first += num_blocks
    batch["block_tables"] = tables
    tree = concat_masks([causal_mask(1), causal_mask(7), tree_mask([-1, 0, 0, 1, 2])]).to(device)
    plan = PagedAttentionPlan(tables, batch["seq_lens"], batch["query_start_loc"], block_size, 3, tree)
    assert all(isinstance(s.kv, slice) for s in plan.sequences)
    check("cpu", batch, tree_mask=tree)
    check("cpu", batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("consecutive", [True, False], ids=["slice", "gathered"])
def test_a_tree_row_equals_the_tokens_it_sees_attended_as_a_chain_and_the_cache_is_left_as_it_was(consecutive, dtype):
    """A row that sees some of the step's tokens (a tree node: its ancestors) attends over the context and those
    exactly as the same tokens decoded one after another would, bit for bit (so a verified guess's logits are those
    of the token decoded), and the step's K/V, laid aside while a row's ancestors stand in their place, are back in
    the cache afterwards. The last row sees every token again after rows that did not."""
    torch.manual_seed(0)
    ctx, block_size, kv_heads, group, dim = 13, 4, 2, 3, 16
    seen = [[0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 5], [0, 1, 2, 3, 4, 5, 6]]  # parents -1, 0, 0, 1, 2, 0
    q_len = len(seen)
    dense = torch.zeros(q_len, q_len, dtype=torch.bool)
    for row, nodes in enumerate(seen):
        dense[row, nodes] = True
    num_blocks = math.ceil((ctx + q_len) / block_size)
    blocks = list(range(num_blocks)) if consecutive else list(range(2 * num_blocks - 1, -1, -2))
    table = torch.tensor([blocks])
    k_slots = torch.randn(2 * num_blocks * block_size, kv_heads, dim, dtype=dtype)
    v_slots = torch.randn_like(k_slots)
    q = torch.randn(q_len, kv_heads * group, dim)
    before = k_slots.clone(), v_slots.clone()
    plan = PagedAttentionPlan(table, torch.tensor([ctx + q_len]), torch.tensor([0, q_len]), block_size, group,
                              pack_mask(dense))
    assert isinstance(plan.sequences[0].kv, slice) == consecutive
    out = plan.attend(q, k_slots, v_slots)
    assert torch.equal(k_slots, before[0]) and torch.equal(v_slots, before[1])
    slots = (table[0, :, None] * block_size + torch.arange(block_size)).flatten()
    for row, nodes in enumerate(seen):
        chain_k, chain_v = k_slots.clone(), v_slots.clone()  # the tokens it sees right after the context
        chain_k[slots[ctx:ctx + len(nodes)]] = k_slots[slots[ctx + torch.tensor(nodes)]]
        chain_v[slots[ctx:ctx + len(nodes)]] = v_slots[slots[ctx + torch.tensor(nodes)]]
        chain = PagedAttentionPlan(table, torch.tensor([ctx + len(nodes)]), torch.tensor([0, len(nodes)]),
                                   block_size, group)
        assert torch.equal(chain.attend(q[nodes], chain_k, chain_v)[-1], out[row]), f"row {row}"


@pytest.mark.parametrize("group", [1, 3, 4])
def test_cpu_attention_is_the_same_at_every_thread_count(group):
    """The engine changes its thread count with the machine's load, so a row's attention must not depend on it:
    a decode and a short verify over a long context, bit for bit at one thread and at two (or more)."""
    batch = make_batch([1, 4], [700, 300], num_q_heads=3 * group, num_kv_heads=3, head_dim=64, block_size=16,
                       device="cpu")
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, max(threads, 2)):
            torch.set_num_threads(n)
            outs.append(run("cpu", batch))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
