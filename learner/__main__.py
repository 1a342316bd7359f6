"""``python -m learner [config.yaml] [key=value ...]``: the VAPO learner (see learner/train.py)."""

import sys

from learner.train import main

sys.exit(main())
