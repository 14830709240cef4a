"""``python -m magnetar.calibrate`` = ``magnetar-calibrate`` (see :mod:`magnetar.calibrate.cli`)."""
import sys

from magnetar.calibrate.cli import main

sys.exit(main())
