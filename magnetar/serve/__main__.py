"""``python -m magnetar.serve`` (also ``torchrun -m`` and ``deepspeed --module``): :func:`magnetar.serve.cli.main`."""
import sys

from magnetar.serve.cli import main

if __name__ == "__main__":
    sys.exit(main())
