"""The tests' own helper modules (``input_kinds``) import by name, under pytest's importlib mode
too, which puts no test folder on ``sys.path``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
