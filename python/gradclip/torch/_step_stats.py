"""The optimizers' step telemetry (``stats=True``): what the update kernel tallied of every
parameter as it updated it, read lazily.

The step itself writes, per parameter, five float64 on the parameters' device (no extra pass over
the tensors, no host synchronization): the sum of the squared update ``p_after - p_before`` (the
stored parameters', weight decay included), the sum of the squared parameter after the step, the
largest finite |g| of the stored gradient, the count of its non-finite elements and the elements
updated (0 for a parameter without a gradient, and for every parameter of a skipped step). The
figures users log are made from them when asked (``figures``): per clip group, or per parameter."""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

#: Float64 per parameter in the records.
WORDS = 5

#: The figures, in the order ``figures`` gives them.
NAMES = ("grad_norm", "clip_coef", "update_norm", "update_rms", "param_norm", "update_to_param", "grad_max_abs", "nonfinite", "skipped")


def records(layout, params: List[torch.Tensor], device) -> torch.Tensor:
    """The layout's records (one row per parameter of ``params``, the optimizer's order), kept
    from step to step (a captured step writes the same tensor at every replay). The step writes
    the row of every parameter it lists: every parameter with a state, whatever its gradient,
    unless some parameter has no elements, when the engine lists only those with a gradient;
    then the records are zeroed before each step (a parameter left out reads as nothing
    updated). A parameter without a state yet keeps the zeros it was made with."""
    r = getattr(layout, "records", None)
    if r is None or r.shape[0] != len(params) or r.device != torch.device(device):
        r = layout.records = torch.zeros(len(params), WORDS, dtype=torch.float64, device=device)
        layout.records_clear = any(p.numel() == 0 for p in params)
    elif layout.records_clear:
        r.zero_()
    return r


def coefficient(norm: torch.Tensor, max_norm: Optional[float]) -> torch.Tensor:
    """The clip coefficient of ``norm`` for ``max_norm`` (torch's and the engine's
    ``min(1, max_norm / (norm + 1e-6))`` in float64; 1 for a clip group measured, not clipped)."""
    if max_norm is None:
        return torch.ones_like(norm)
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def _figures(rec: torch.Tensor, grad_norm, coef, skipped) -> Dict[str, torch.Tensor]:
    """The figures of the records ``rec`` (rows summed: one clip group, or per row when ``rec``
    is 2-D and its sums are taken per row by the caller)."""
    update_norm = rec[..., 0].sqrt()
    param_norm = rec[..., 1].sqrt()
    elements = rec[..., 4]
    return {
        "grad_norm": grad_norm,
        "clip_coef": coef,
        "update_norm": update_norm,
        "update_rms": torch.where(elements > 0, update_norm / elements.clamp(min=1).sqrt(), torch.zeros_like(update_norm)),
        "param_norm": param_norm,
        "update_to_param": torch.where(param_norm > 0, update_norm / param_norm.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(param_norm)),
        "grad_max_abs": rec[..., 2],
        "nonfinite": rec[..., 3].to(torch.int64),
        "skipped": skipped,
    }


def group_totals(rec: torch.Tensor, members: Dict[str, List[int]]) -> torch.Tensor:
    """Each clip group's records summed over its rows (``members``, in order): one row of five
    per clip group, the largest |g| its rows' maximum."""
    rows = []
    for ids in members.values():
        part = rec.index_select(0, torch.tensor(ids, dtype=torch.long, device=rec.device))
        big = part[:, 2].amax() if len(ids) else part.new_zeros(())
        rows.append(torch.stack([part[:, 0].sum(), part[:, 1].sum(), big, part[:, 3].sum(), part[:, 4].sum()]))
    return torch.stack(rows) if rows else rec.new_zeros((0, WORDS))


def skipped_of(total: torch.Tensor) -> torch.Tensor:
    """Whether a clip group's step (its ``group_totals`` row) was skipped: it updated no element
    of gradients it read (a skipped step tallies each gradient it leaves: its largest |g| and
    non-finite count; a clip group without gradients updates nothing and tallies nothing)."""
    return (total[4] == 0) & ((total[2] > 0) | (total[3] > 0))


def figures(
    rec: torch.Tensor,
    members: Dict[str, List[int]],
    norms: Dict[str, Optional[torch.Tensor]],
    coefs: Dict[str, Optional[torch.Tensor]],
    totals: torch.Tensor,
    per_param: bool,
    as_floats: bool,
):
    """Per clip group name (``members``: its parameters' rows), the figures of ``NAMES``: 0-dim
    float64 tensors on the device from the clip groups' ``totals`` (``group_totals``, in
    ``members``' order), or, with ``per_param``, 1-D ones from the rows, one value per parameter
    of the group in the optimizer's order; floats after one synchronization (``as_floats``).
    ``grad_norm`` and ``clip_coef`` are the clip group's (None without a clip)."""
    out = {}
    for k, (name, rows) in enumerate(members.items()):
        skipped = skipped_of(totals[k])
        if per_param:
            part = rec.index_select(0, torch.tensor(rows, dtype=torch.long, device=rec.device))
            out[name] = _figures(part, norms.get(name), coefs.get(name), skipped)
        else:
            out[name] = _figures(totals[k], norms.get(name), coefs.get(name), skipped)
    if as_floats:
        # Every figure in one copy to the host: one synchronization.
        flat = [(k, n, v) for k, d in out.items() for n, v in d.items() if v is not None]
        host = torch.cat([v.reshape(-1).to(torch.float64) for _, _, v in flat]).cpu().tolist() if flat else []
        at, floats = 0, {k: {n: None for n in d} for k, d in out.items()}
        for k, n, v in flat:
            size = v.numel()
            vals = host[at : at + size]
            at += size
            floats[k][n] = vals if v.dim() else (bool(vals[0]) if n == "skipped" else int(vals[0]) if n == "nonfinite" else vals[0])
            if v.dim() and n == "nonfinite":
                floats[k][n] = [int(x) for x in vals]
        return floats
    return out
