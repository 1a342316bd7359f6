"""``python -m learner [config.yaml] [key=value ...]``: the VAPO learner process (see learner/runner.py)."""

import sys

from learner.runner import main

sys.exit(main())
