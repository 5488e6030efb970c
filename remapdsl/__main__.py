"""`python -m remapdsl`: the same command line as the `remapdsl` script."""

import sys

from .cli import main

sys.exit(main())
