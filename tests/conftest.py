"""Shared test set-up: the repo root on sys.path so tests run without install."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# plugin modules that tests also import helpers from: rewrite their asserts
# on that first import (pytest would warn that it came too late otherwise)
pytest.register_assert_rewrite("tests.support.ha_fixtures")
