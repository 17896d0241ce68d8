"""`python -m k3serve.cli`: the same entry point as the `k3serve` script."""

import sys

from k3serve.cli.entry import main

sys.exit(main())
