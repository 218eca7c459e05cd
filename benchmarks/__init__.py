"""accumjax benchmarks: run `python -m benchmarks.run_all` from the repository root."""
