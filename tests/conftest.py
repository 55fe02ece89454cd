"""Make tests/ importable so tests can share helper modules (`from helpers_tiny_models import ...`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
