"""What the command lines share below them all (:mod:`magnetar.cli.args`); the ``magnetar`` command itself, with
its subcommands, is :mod:`magnetar.commands`."""
