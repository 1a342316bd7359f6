"""The chaos run's parts (``python -m ops.bench.chaos``): processes, the nemesis, the history and its checks."""
