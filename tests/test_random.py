"""Counter-based uniforms: Triton (interpreted on CPU) bit-identical to the torch reference, and
uniform enough to sample with. The kernel on the test device; the statistics of the reference on the CPU."""

import torch
import triton
import triton.language as tl

from nanospec.kernels.random import uniform, uniform_ref

EDGE_SEEDS = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**63 - 1, -1, -2, -(2**31), -(2**32), -(2**63)]


@triton.jit
def _uniform_grid_kernel(seeds_ptr, offsets_ptr, indices_ptr, out_ptr, num_indices, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_indices
    indices = tl.load(indices_ptr + cols, mask=mask, other=0)
    u = uniform(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row), indices)
    tl.store(out_ptr + row * num_indices + cols, u, mask=mask)


@triton.jit
def _uniform_constant_index_kernel(seeds_ptr, offsets_ptr, out_ptr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, uniform(tl.load(seeds_ptr + row), tl.load(offsets_ptr + row), 3))


def uniform_triton(seeds, offsets, indices):
    out = torch.empty(seeds.numel(), indices.numel(), dtype=torch.float32, device=seeds.device)
    block = triton.next_power_of_2(indices.numel())
    _uniform_grid_kernel[(seeds.numel(),)](seeds, offsets, indices, out, indices.numel(), BLOCK=block)
    return out


def test_triton_is_bit_identical_to_ref(device):
    generator = torch.Generator().manual_seed(0)
    random_seeds = torch.randint(-(2**63), 2**63 - 1, (51,), generator=generator, dtype=torch.int64)
    seeds = torch.cat([torch.tensor(EDGE_SEEDS), random_seeds])
    offsets = torch.randint(-(2**40), 2**40, (seeds.numel(),), generator=generator, dtype=torch.int64)
    offsets[:4] = torch.tensor([0, 1, 2**32, 2**32 - 1])
    indices = torch.cat([torch.arange(1000), torch.tensor([2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, -1])])
    seeds, offsets, indices = seeds.to(device), offsets.to(device), indices.to(device)

    out = uniform_triton(seeds, offsets, indices)
    expected = uniform_ref(seeds[:, None], offsets[:, None], indices[None, :])
    assert torch.equal(out, expected)

    constant_index = torch.empty(seeds.numel(), device=device)
    _uniform_constant_index_kernel[(seeds.numel(),)](seeds, offsets, constant_index)
    assert torch.equal(constant_index, uniform_ref(seeds, offsets, 3))


def test_values_lie_on_the_open_grid():
    # u = (2j + 1) / 2**24: strictly inside (0, 1), and u * 2**24 an exact odd integer
    u = uniform_ref(torch.tensor(EDGE_SEEDS)[:, None], 0, torch.arange(100_000)[None, :])
    assert float(u.min()) > 0 and float(u.max()) < 1
    scaled = u.double() * 2**24
    assert torch.equal(scaled, scaled.round()) and bool((scaled.long() % 2 == 1).all())


def test_python_ints_and_tensors_agree():
    assert uniform_ref(2**40 + 3, 17, 5).item() == uniform_ref(torch.tensor(2**40 + 3), torch.tensor(17), 5).item()


def test_uniformity_mean_and_chi_square():
    # 10**6 draws over consecutive seeds and offsets, the way requests and steps use them
    n = 1000
    u = uniform_ref(torch.arange(n)[:, None], torch.arange(n)[None, :], 0).flatten().double()
    # mean of U(0, 1): standard error sqrt(1/12/10**6) = 2.9e-4; allow 5 of them
    assert abs(u.mean().item() - 0.5) < 5 * (1 / 12 / u.numel()) ** 0.5
    # chi-square over 100 equal bins, 99 degrees of freedom: mean 99, sd 14; P(> 180) is about 1e-6
    counts = torch.bincount((u * 100).long(), minlength=100).double()
    expected = u.numel() / 100
    assert ((counts - expected) ** 2 / expected).sum().item() < 180

    # consecutive indices of one (seed, offset): the per-token numbers a sampling step uses
    v = uniform_ref(12345, 678, torch.arange(10**6)).double()
    counts = torch.bincount((v * 100).long(), minlength=100).double()
    assert ((counts - expected) ** 2 / expected).sum().item() < 180
    # neighbouring indices are uncorrelated: |corr| of 10**6 independent pairs is ~1e-3
    assert abs(torch.corrcoef(torch.stack([v[:-1], v[1:]]))[0, 1].item()) < 5e-3


def test_seeds_apart_in_their_high_half_share_no_stream():
    """Seeds 2**32 apart differ only in the high half: their numbers at any two offsets are unrelated."""
    index = torch.arange(1000)[None, :]
    for seed in (0, 12345, -7):
        first = uniform_ref(torch.tensor([[seed]]), torch.arange(8)[:, None], index)
        other = uniform_ref(torch.tensor([[seed + 2**32]]), torch.arange(8)[:, None], index)
        assert not any(torch.equal(first[i], other[j]) for i in range(8) for j in range(8))
