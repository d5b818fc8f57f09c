"""`python -m redline ...`: the same command line as `redline ...`."""

import sys

from redline.cli import main

sys.exit(main())
