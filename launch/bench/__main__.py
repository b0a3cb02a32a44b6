"""``python -m spotline.launch.bench ...``: the same as ``spotline bench ...``."""

from __future__ import annotations

import sys

from spotline.launch.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
