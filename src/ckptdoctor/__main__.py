"""`python -m ckptdoctor ...`: what launchers run (torchrun -m ckptdoctor selftest ...)."""

import sys

from .cli import main

sys.exit(main())
