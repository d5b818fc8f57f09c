"""Public data sets from installed packages: ShareGPT conversations (sharegpt.py) and HumanEval problems
(humaneval.py), each with a fixed held-out part; sources.py resolves `--data` values."""
