"""``python -m rankscope.pipeline.cli`` is the same as ``rankscope``."""

import sys

from rankscope.pipeline.cli.main import main

sys.exit(main())
