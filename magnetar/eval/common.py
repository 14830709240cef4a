"""The command-line helpers of the evaluation CLIs: they live in :mod:`magnetar.cli.args`, below every command line
(``magnetar-run`` and ``magnetar serve`` use them too); re-exported here for the eval modules and their users."""
from magnetar.cli.args import (check_attention_backend, check_cp_size, engine_config, parse_length, parse_lengths,
                               parse_links, parse_names)

__all__ = ["engine_config", "parse_length", "parse_lengths", "parse_links", "parse_names", "check_attention_backend",
           "check_cp_size"]
