"""``python -m loadtest compare ...`` (see loadtest/compare.py)."""

import sys

from loadtest.compare import main

sys.exit(main())
