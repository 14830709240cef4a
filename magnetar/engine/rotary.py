"""On a CPU, a model's rotary position embedding computed by Magnetar's one-pass op (:mod:`magnetar.ops.rotary`) --
where the function its attention calls gives the op's values bit for bit on a probe, so that an embedding of another
formula (a partial rotary, an interleaved one) keeps its own.

Torch runs transformers' ``apply_rotary_pos_emb`` as nine ops a tensor, most a parallel region: 0.7-1.4 ms a layer
of a 1000-token bf16 query of SmolLM2 on two cores of the Intel AMX VM, 2.6-4.5 ms for four joined queries, where the
op takes 0.25 and 0.9 (docs/results.md, "One pass for the rotary embedding").

No module holds the embedding: each attention's ``forward`` calls its modelling file's module-level
``apply_rotary_pos_emb`` by name. So the function is replaced *in that file's namespace* (the one place transformers
offers; its modules and their classes stay untouched) by a wrapper that calls the op for CPU tensors of one float32
or bfloat16 dtype called as ``(q, k, cos, sin)`` outside autograd and ``torch.compile``, and the function itself
otherwise. The replacement is for the process (every model of that file in it: the values are the function's own,
which the probe checked in both dtypes at the model's head size); :func:`restore_rotary` puts the function back.
"""
from __future__ import annotations

import functools
import logging
import sys
from typing import Callable, Optional

import torch
from torch import nn

from magnetar.ops.rotary import rotary, rotary_checked, rotary_refusal, rotary_unavailable

log = logging.getLogger(__name__)

_NAME = "apply_rotary_pos_emb"
_OWN = "_magnetar_own"  # the wrapper's attribute holding the function it replaced
_PROBE = ((2, 3, 5), (1, 2, 16))  # (B, H, S) of the probes: several batch rows and heads, one batch row for cos


def _wrapped(own: Callable) -> Callable:
    @functools.wraps(own)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if (args or kwargs.get("unsqueeze_dim", 1) != 1 or len(kwargs) > ("unsqueeze_dim" in kwargs)
                or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or rotary_refusal(q, k, cos, sin) is not None):
            return own(q, k, cos, sin, *args, **kwargs)
        return rotary_checked(q, k, cos, sin)

    setattr(apply_rotary_pos_emb, _OWN, own)
    return apply_rotary_pos_emb


def _head_dim(model: nn.Module) -> Optional[int]:
    config = getattr(model, "config", None)
    d = getattr(config, "head_dim", None)
    if d is None and getattr(config, "num_attention_heads", None):
        d = config.hidden_size // config.num_attention_heads
    return d if isinstance(d, int) and d > 0 and d % 2 == 0 else None


def _layout(t: torch.Tensor) -> tuple:
    """``t``'s strides where they matter (a dimension of size 1 has any)."""
    return tuple(st for st, n in zip(t.stride(), t.shape) if n > 1)


def _agrees(own: Callable, D: int) -> bool:
    """Whether the op gives ``own``'s values bit for bit (dtype, shape and strides included) on probes of head size
    ``D`` in float32 and bfloat16: q and k views of a projection's output as the attention makes them, cos and sin
    for every batch row and for one."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for B, H, S in _PROBE:
            q = (3 * torch.randn(B, S, H * D, generator=g)).to(dtype).view(B, S, H, D).transpose(1, 2)
            k = (3 * torch.randn(B, S, D, generator=g)).to(dtype).view(B, S, 1, D).transpose(1, 2)
            for rows in (B, 1):
                cos, sin = (torch.randn(rows, S, D, generator=g).to(dtype) for _ in range(2))
                try:
                    with torch.no_grad():
                        want = own(q, k, cos, sin)
                except Exception:  # noqa: BLE001 - a function of another signature or shape rule: not this formula
                    return False
                got = rotary(q, k, cos, sin)
                if not (isinstance(want, tuple) and len(want) == 2 and all(
                        isinstance(w, torch.Tensor) and w.dtype == x.dtype and w.shape == x.shape
                        and _layout(w) == _layout(x) and torch.equal(w, x) for w, x in zip(want, got))):
                    return False
    return True


def _files(model: nn.Module) -> list:
    """The modelling files (Python modules) of ``model``'s module classes that define ``apply_rotary_pos_emb``."""
    out, seen = [], set()
    for m in model.modules():
        name = type(m).__module__
        mod = sys.modules.get(name)
        if name in seen or mod is None or not callable(getattr(mod, _NAME, None)):
            continue
        seen.add(name)
        out.append(mod)
    return out


def fuse_rotary(model: nn.Module, device: torch.device) -> Optional[str]:
    """On a CPU, the op put in the ``apply_rotary_pos_emb`` of each of ``model``'s modelling files whose function it
    agrees with (module docstring): what was done, for the log; None where nothing was to do (another device, no
    such file, no usable head size, or the op unavailable: logged)."""
    if device.type != "cpu":
        return None
    files, D = _files(model), _head_dim(model)
    if not files or D is None:
        return None
    reason = rotary_unavailable()
    if reason is not None:
        log.info("rotary embedding: transformers' own function (%s)", reason)
        return None
    done = []
    for mod in files:
        fn = getattr(mod, _NAME)
        if hasattr(fn, _OWN):  # put there by an earlier engine (it checked its own head size)
            done.append(mod.__name__)
        elif _agrees(fn, D):
            setattr(mod, _NAME, _wrapped(fn))
            done.append(mod.__name__)
        else:
            log.info("rotary embedding: %s.%s keeps its own values (another formula than the op's)", mod.__name__,
                     _NAME)
    if not done:
        return None
    what = f"{', '.join(f'{n}.{_NAME}' for n in done)} computed by Magnetar's one-pass op on CPU tensors"
    log.info("rotary embedding: %s", what)
    return what


def restore_rotary(model: nn.Module) -> list[str]:
    """Put back the function :func:`fuse_rotary` replaced in ``model``'s modelling files; the files restored."""
    out = []
    for mod in _files(model):
        own = getattr(getattr(mod, _NAME), _OWN, None)
        if own is not None:
            setattr(mod, _NAME, own)
            out.append(mod.__name__)
    return out
