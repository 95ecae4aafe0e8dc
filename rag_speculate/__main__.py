"""`python -m rag_speculate`: the `rag-speculate` command line."""

import sys

from .entrypoints.cli import main

sys.exit(main())
