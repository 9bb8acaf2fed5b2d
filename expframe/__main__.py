"""`python -m expframe ...`: the same program as `python main.py ...` (see expframe/cli.py)."""

from expframe.cli import main

main()
