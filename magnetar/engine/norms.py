"""On a CPU, a model's RMSNorm modules computed by Magnetar's one-pass op (:mod:`magnetar.ops.rms_norm`) -- each
where its own forward gives the same values on a probe, so that a norm of another formula (Gemma's ``1 + weight``, a
float32 weight over bf16 activations) keeps its own.

Torch runs Hugging Face's ``LlamaRMSNorm`` as eight ops, most a parallel region: 61 of them took up to a sixth of a
1000-token bf16 query forward of SmolLM2-135M on the Intel AMX VM, the op a third of their time (docs/results.md, "One
pass for RMSNorm"). A module is a candidate when
it has a 1-D ``weight`` and a float ``variance_epsilon`` (the attribute every Llama-family norm in transformers
keeps) and no children; its class becomes a subclass whose ``forward`` calls the op for CPU tensors of the weight's
dtype outside autograd and ``torch.compile``, and the class's own ``forward`` otherwise.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from magnetar.ops.rms_norm import rms_norm, rms_norm_unavailable

log = logging.getLogger(__name__)

_PROBE_ROWS = 4
# how close the op's values must be to the module's own on the probe: a rounding of the dtype (the float32 sums run
# in another order, so a bf16 element may round the other way), where another formula is off by far more
_AGREE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7}
_FUSED: dict[type, type] = {}  # a norm class -> its subclass calling the op


def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if (hidden_states.device.type != "cpu" or hidden_states.dtype != self.weight.dtype or torch.is_grad_enabled()
            or torch.compiler.is_compiling()):
        return self._magnetar_own_forward(hidden_states)
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _fused_class(cls: type) -> type:
    if cls not in _FUSED:
        _FUSED[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": _forward, "_magnetar_own_forward": cls.forward,
                                                             "__module__": cls.__module__})
    return _FUSED[cls]


def _candidates(model: nn.Module) -> list[nn.Module]:
    out = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (type(m) in _FUSED.values() or next(m.children(), None) is not None or not isinstance(w, torch.Tensor)
                or w.dim() != 1 or not isinstance(getattr(m, "variance_epsilon", None), float)):
            continue
        out.append(m)
    return out


def _agrees(m: nn.Module) -> bool:
    """Whether the op gives ``m``'s own values (dtype included) on a probe of a few rows of its width."""
    w = m.weight
    if w.dtype not in _AGREE_RTOL or w.device.type != "cpu":
        return False
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(_PROBE_ROWS, w.shape[0], generator=g)).to(w.dtype)
    with torch.no_grad():
        own = m(x)
        got = rms_norm(x, w, m.variance_epsilon)
    if own.dtype != got.dtype or own.shape != got.shape:
        return False
    return torch.allclose(got.float(), own.float(), rtol=_AGREE_RTOL[w.dtype], atol=1e-6)


def fuse_norms(model: nn.Module, device: torch.device) -> Optional[str]:
    """On a CPU, the op swapped into each of ``model``'s RMSNorm modules it agrees with (module docstring): what was
    done, for the log; None where nothing was to do (another device, no candidate, or the op unavailable: logged)."""
    if device.type != "cpu":
        return None
    candidates = _candidates(model)
    if not candidates:
        return None
    reason = rms_norm_unavailable()
    if reason is not None:
        log.info("RMSNorm: the modules' own forward (%s)", reason)
        return None
    fused = [m for m in candidates if _agrees(m)]
    for m in fused:
        m.__class__ = _fused_class(type(m))
    what = f"{len(fused)} of {len(candidates)} RMSNorm modules computed by Magnetar's one-pass op"
    log.info("RMSNorm: %s", what)
    return what
