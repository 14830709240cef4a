"""Entry points: starting torch.distributed under ``deepspeed`` / ``torchrun`` and the command-line tools."""
from magnetar.parallel.launcher import add_launcher_args, init_distributed

__all__ = ["init_distributed", "add_launcher_args"]
