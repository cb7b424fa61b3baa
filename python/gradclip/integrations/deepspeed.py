"""gradclip's optimizers as DeepSpeed's client optimizer: the clip inside the optimizer's step
(one norm pass, fused into the update), DeepSpeed's own clip off, ZeRO-1/2 included.

DeepSpeed's extension point is the client optimizer (``deepspeed.initialize(optimizer=...)``);
under ZeRO-1/2 it steps the optimizer over this rank's flat partition of the parameters, so the
optimizer must sum the norm over the data-parallel group: ``initialize`` hands it the group ZeRO
partitions over (``shards_over``), turns DeepSpeed's own norm off
(``zero_optimization.compute_grad_norm=false``) and has ``engine.get_global_grad_norm()`` report
gradclip's norm (a step hook of the optimizer's, which writes DeepSpeed's private
``_global_grad_norm``: there is no public way to hand DeepSpeed a norm).

>>> engine, optimizer, _, _ = gradclip.integrations.deepspeed.initialize(
...     model=model, optimizer=gradclip.torch.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0),
...     config={"train_batch_size": 8, "zero_optimization": {"stage": 2}})

What it refuses, before DeepSpeed builds anything: a config that clips as well
(``gradient_clipping``, the norm twice; left out, it is set to 0, since DeepSpeed's default of
1.0 clips), ZeRO-3, optimizer offload, fp16 loss scaling, bf16 without ZeRO, a model-parallel
``mpu`` and MoE expert groups (partitioned over other groups than the rest). With several param
groups under ZeRO (which steps the optimizer one group at a time, before the later groups'
gradients exist) the norm is DeepSpeed's, taken before its loop and handed to the optimizer
(``provide_grad_norm``) by a step hook; the clip is still inside the update."""

from __future__ import annotations

import json
from typing import Any, Dict, Tuple

from ._framework import require

#: DeepSpeed releases this adapter is tested with.
TESTED = ("0.19",)


def initialize(*, optimizer, config, **kwargs) -> Tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize(optimizer=optimizer, config=config, **kwargs)`` with ``optimizer``
    (one of ``gradclip.torch.optim``'s, clipping with its ``max_grad_norm``) as the client
    optimizer, checked and configured as this module says; returns DeepSpeed's four values."""
    from ..torch._spine import _ClippingStep

    if not isinstance(optimizer, _ClippingStep):
        raise TypeError(f"optimizer is {type(optimizer).__name__}: pass one of gradclip.torch.optim's optimizers (AdamW, Adam, SGD, Lion)")
    config = _config(config)
    zero = dict(config.get("zero_optimization") or {})
    stage = int(zero.get("stage", 0))
    clipping = float(config.get("gradient_clipping", 0.0) or 0.0)
    if clipping != 0.0:
        raise ValueError(
            f"the DeepSpeed config clips too (gradient_clipping={clipping}), which computes the norm a second time: "
            "leave gradient_clipping out (or 0) and set max_grad_norm on gradclip's optimizer"
        )
    # Left out, DeepSpeed's default (1.0) would clip as well: gradclip's optimizer clips alone.
    config["gradient_clipping"] = 0.0
    if stage == 3:
        raise ValueError("ZeRO-3 is not supported by gradclip's DeepSpeed adapter: use ZeRO-1/2, or DeepSpeed's gradient_clipping")
    if (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
        raise ValueError("optimizer offload is not supported by gradclip's DeepSpeed adapter (its CPU optimizer clips on its own)")
    if (config.get("fp16") or {}).get("enabled", False):
        raise ValueError("fp16 loss scaling is not supported by gradclip's DeepSpeed adapter: use bf16 with ZeRO-1/2, or fp32")
    if (config.get("bf16") or config.get("bfloat16") or {}).get("enabled", False) and stage == 0:
        raise ValueError("bf16 without ZeRO is not supported by gradclip's DeepSpeed adapter: use ZeRO stage 1 or 2")
    if kwargs.get("mpu") is not None:
        raise ValueError("a model-parallel mpu is not supported by gradclip's DeepSpeed adapter: its shards would need its groups too")
    clipping = optimizer.max_grad_norm is not None
    # Under ZeRO-1/2 with one param group the optimizer takes the norm itself (over the
    # partitions: shards_over); with several, ZeRO steps it one group at a time, before the
    # later groups' gradients exist, so DeepSpeed's norm (taken before its loop) is handed in.
    own_norm = clipping and (stage == 0 or len([g for g in optimizer.param_groups if g["params"]]) == 1)
    if stage in (1, 2):
        if own_norm and zero.get("compute_grad_norm") is True:
            raise ValueError("zero_optimization.compute_grad_norm=true computes the norm a second time: leave it out")
        if clipping and not own_norm and zero.get("compute_grad_norm") is False:
            raise ValueError("zero_optimization.compute_grad_norm=false: with several param groups the clip needs DeepSpeed's norm")
        config["zero_optimization"] = {**zero, "compute_grad_norm": not own_norm and zero.get("compute_grad_norm", True)}
        # DeepSpeed's word for a client optimizer it has no test of: this adapter's tests are.
        config["zero_allow_untested_optimizer"] = True
    deepspeed = require("deepspeed", "deepspeed", TESTED)
    engine, opt, loader, scheduler = deepspeed.initialize(optimizer=optimizer, config=config, **kwargs)
    if stage in (1, 2):
        partitions = set(map(id, engine.optimizer.real_dp_process_group))
        if len(partitions) != 1:
            raise ValueError("MoE expert groups are not supported by gradclip's DeepSpeed adapter: use DeepSpeed's gradient_clipping")
        if own_norm:
            optimizer.shards_over = (engine.optimizer.real_dp_process_group[0],)
        elif clipping:
            zero_opt = engine.optimizer
            optimizer.register_step_pre_hook(lambda opt, args, kw: opt.provide_grad_norm(_as_tensor(zero_opt._global_grad_norm)))
    if own_norm:
        reporter = engine.optimizer if stage in (1, 2) else engine
        optimizer.register_step_post_hook(lambda opt, args, kw: setattr(reporter, "_global_grad_norm", opt.last_grad_norm))
    return engine, opt, loader, scheduler


def _as_tensor(norm):
    """DeepSpeed's norm as a 0-dim tensor (it keeps a tensor; a float where it was given one)."""
    import torch

    return norm if isinstance(norm, torch.Tensor) else torch.tensor(float(norm), dtype=torch.float64)


def _config(config) -> Dict[str, Any]:
    """A copy of DeepSpeed's config, given as a dict or a JSON file's path."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    if isinstance(config, str):
        with open(config) as f:
            return json.load(f)
    raise TypeError(f"config is {type(config).__name__}: pass DeepSpeed's config as a dict or a JSON file's path")
