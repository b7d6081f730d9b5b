"""``python -m pipeline`` is the same as ``rankscope``."""

import sys

from pipeline.cli import main

sys.exit(main())
