"""Reports: ``docs/RESULTS.md``'s sections and plots, made from finished run directories (``run_records``
reads them back); ``compute_axes`` compares any set of runs at equal compute."""
