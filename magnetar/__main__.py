"""``python -m magnetar COMMAND [ARGS]``: the ``magnetar`` command (:mod:`magnetar.commands`)."""
import sys

from magnetar.commands import main

sys.exit(main())
