"""Template-parameter sweep: the same tool as `python -m clops tune` (see clops/tune.py), runnable from a checkout."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from clops.tune import main  # noqa: E402

raise SystemExit(main())
