"""`python -m service serve ...` is `tserve serve ...`."""

import sys

from service.cli import main

sys.exit(main())
