"""`python -m tserve serve ...` is `tserve serve ...`."""

import sys

from tserve.service.cli import main

sys.exit(main())
