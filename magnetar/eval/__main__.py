"""``python -m magnetar.eval`` = ``magnetar-eval`` (see :mod:`magnetar.eval.runner`)."""
import sys

from magnetar.eval.runner import main

sys.exit(main())
