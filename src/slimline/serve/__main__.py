"""``python -m slimline.serve``: the same as ``slimline serve``."""

import sys

from .cli import main

sys.exit(main())
