"""``gradclip.torch.get_tensor_norms``: each tensor's norm against torch's f64 norm of it, on
fresh random tensors of every dtype the engine reads and of kinds it does not (strided,
complex), empty ones, every norm order, list and generator input; what is refused; CUDA equals
the CPU backend."""

import math

import pytest
import torch

from gradclip.torch import get_tensor_norms

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


def _tensors(seed, device, mixed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (shape, dtype) in enumerate(
        [((64, 33), torch.float32), ((1000,), torch.bfloat16), ((7, 3, 5), torch.float16), ((40000,), torch.float64), ((0, 3), torch.float32), ((1,), torch.bfloat16)]
    ):
        out.append((torch.randn(shape, generator=g) * 10 ** (k % 3 - 1)).to(dtype).to(device))
    if mixed:
        out.append(torch.randn(12, 9, generator=g).to(device).t())  # strided: torch's norm
        out.append(torch.randn(5, generator=g, dtype=torch.complex64).to(device))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("mixed", [False, True])
def test_each_norm_equals_torch_in_f64(device, p, mixed):
    ts = _tensors((4 if math.isinf(p) else int(p)) * 2 + mixed, device, mixed)
    got = get_tensor_norms((t for t in ts), p)  # a generator, read once
    # An empty tensor's norm is 0 for every order (torch refuses the inf-norm of one).
    want = torch.stack([
        torch.linalg.vector_norm(t.to(torch.complex128 if t.is_complex() else torch.float64), p).to(torch.float64).cpu()
        if t.numel() else torch.tensor(0.0, dtype=torch.float64)
        for t in ts
    ]).to(ts[0].device)
    assert got.dtype == torch.float64 and got.device == ts[0].device and got.shape == (len(ts),)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


def test_refusals_name_the_tensor():
    ts = _tensors(1, "cpu", False)
    with pytest.raises(TypeError, match="tensor 2 is NoneType"):
        get_tensor_norms(ts[:2] + [None])
    with pytest.raises(ValueError, match="norm_type >= 1"):
        get_tensor_norms(ts, 0.5)
    assert get_tensor_norms([]).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_equals_the_cpu_backend_to_the_bit():
    ts = _tensors(5, "cpu", False)
    assert torch.equal(get_tensor_norms(ts), get_tensor_norms([t.cuda() for t in ts]).cpu())
