"""Entry points: starting torch.distributed under ``deepspeed`` / ``torchrun`` and the command-line tools.

``init_distributed`` (:mod:`magnetar.parallel.launcher`) is imported when first used (PEP 562), so that a command's
``--help`` and its flags' errors (``magnetar run``) come before torch is imported.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from magnetar.utils.cli import add_launcher_args

__all__ = ["init_distributed", "add_launcher_args"]

if TYPE_CHECKING:
    from magnetar.parallel.launcher import init_distributed


def __getattr__(name: str):
    if name == "init_distributed":
        from magnetar.parallel.launcher import init_distributed

        return init_distributed
    raise AttributeError(f"module 'magnetar.launch' has no attribute {name!r}")
