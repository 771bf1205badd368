"""``python -m worker.kernels``: compile the CPU attention kernel now (set-up, CI), see :mod:`.native`."""

from worker.kernels.native import main

main()
