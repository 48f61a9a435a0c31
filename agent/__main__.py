"""`python -m agent`: the same as the `dra-agent` command."""

import sys

from agent.commands.cli import main

sys.exit(main())
