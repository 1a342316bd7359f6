"""``python -m learner [config.yaml] [key=value ...]``: the VAPO learner process (see learner/runner.py).

The process leaves through ``learner.dist.exit_process``, without interpreter finalisation, where torch's
gloo threads can abort a rank that finished (its docstring says why)."""

import sys
import traceback

from learner.dist import exit_process
from learner.runner import main


def _run() -> int:
    try:
        return main()
    except SystemExit as e:  # argparse's --help and usage errors
        if isinstance(e.code, int) or e.code is None:
            return int(e.code or 0)
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException:  # any failure: its traceback, then a non-zero exit
        traceback.print_exc()
        return 1


exit_process(_run())
