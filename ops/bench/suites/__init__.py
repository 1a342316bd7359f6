"""Experiment suites: sets of launched training runs compared at equal budgets, run and reported by one command,
``python -m ops.bench.suites.experiments [--suite NAME]``; each ``*_suite.py`` lists its runs and reads them back."""
