"""``python -m pipeline`` is the same as ``rankscope``."""

import sys

from rankscope.pipeline.cli import main

sys.exit(main())
