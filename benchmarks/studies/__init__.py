"""Single-question benchmark studies: each is a script (``python benchmarks/studies/<name>.py``) that
writes or prints one results table; ``benchmarks/README.md`` lists each study's command and results
file."""
