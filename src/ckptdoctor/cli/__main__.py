"""`python -m ckptdoctor.cli ...`, the same as `ckptdoctor ...`."""

import sys

from . import main

sys.exit(main())
