"""One-off GPU probes kept with the results they produced (bench/results/HISTORY.md names each)."""
