"""`python -m dropless.train ...` is `dropless train ...`."""

import sys

from .run import main

sys.exit(main())
