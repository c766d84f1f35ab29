"""`python -m evalbus.cli`, the same as the `evalbus` command."""

import sys

from evalbus.cli import main

sys.exit(main())
