"""``python -m minicpm_jax.train_eagle``: the entry point of :mod:`minicpm_jax.cli.train_eagle` (see there)."""

import os
import signal
import sys


def _exit_now(signum, frame):  # Ctrl-C while the heavy imports run: end at once, no traceback
    sys.stderr.write("\ninterrupted\n")
    os._exit(130)


signal.signal(signal.SIGINT, _exit_now)

from minicpm_jax.cli.train_eagle import main  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)  # training: Ctrl-C saves a checkpoint first

if __name__ == "__main__":
    from absl import app

    app.run(main)
