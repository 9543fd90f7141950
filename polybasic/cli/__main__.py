"""`python -m polybasic.cli ...`: the `polybasic` command."""
import sys

from polybasic.cli import main

sys.exit(main())
