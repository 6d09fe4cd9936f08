"""``python -m quantree_cli``: the ``quantree`` command."""

import sys

from quantree_cli import main

sys.exit(main())
