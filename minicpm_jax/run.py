"""``python -m minicpm_jax.run``: the entry point of :mod:`minicpm_jax.cli.run` (see there)."""

import os
import signal
import sys


def _exit_now(signum, frame):  # Ctrl-C while the heavy imports run: end at once, no traceback
    sys.stderr.write("\ninterrupted\n")
    os._exit(130)


signal.signal(signal.SIGINT, _exit_now)

from minicpm_jax.cli.run import main  # noqa: E402

if __name__ == "__main__":
    from absl import app

    app.run(main)
