"""`python -m tokenfab`: the same as the `tokenfab` command (works without the script on PATH)."""
import sys

from tokenfab.cli import main

sys.exit(main())
