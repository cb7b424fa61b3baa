"""The integration tests import their shared helpers (``frameworks``) from this folder, and
``ranks`` from the one above (conftest.py there)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
