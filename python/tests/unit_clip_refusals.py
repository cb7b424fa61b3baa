"""The inputs every unit-wise clip (``AGC``, ``AdaGC``) refuses before it writes anything, for
their tests: ``(extra parameter, exception, message pattern)`` to append to a list of
parameters with gradients; the pattern names the extra parameter by its position."""

import torch


def refused_extras(params):
    """The refused parameters for a call over ``params`` (the extra one at position
    ``len(params)``): a strided gradient, a sparse one, an fp8 one, and a gradient that is
    another parameter's."""
    i = len(params)
    strided = torch.nn.Parameter(torch.randn(6, 4))
    strided.grad = torch.randn(4, 6).t()
    sparse = torch.nn.Parameter(torch.randn(5, 3))
    sparse.grad = torch.randn(5, 3).to_sparse()
    fp8 = torch.nn.Parameter(torch.randn(5, 3).to(torch.float8_e4m3fn), requires_grad=False)
    fp8.grad = torch.randn(5, 3).to(torch.float8_e4m3fn)
    donor = next(p for p in params if p.grad is not None and p.grad.numel() and p.grad.dtype == p.dtype)
    shared = torch.nn.Parameter(torch.randn(donor.shape, dtype=donor.dtype))
    shared.grad = donor.grad  # one gradient tensor twice
    return [
        (strided, ValueError, f"parameter {i} .*not contiguous"),
        (sparse, TypeError, f"parameter {i} has a sparse gradient"),
        (fp8, TypeError, f"parameter {i} .*float8_e4m3fn"),
        (shared, ValueError, "overlap"),
    ]
