from __future__ import annotations

import os
import sys

# the multi-process workers import these test helpers by module name
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("ARFUSE_LOG", "warning")
