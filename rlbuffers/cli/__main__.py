"""``python3 -m rlbuffers.cli ...``: the ``rlbuffers`` command without the console script."""

import sys

from rlbuffers.cli.main import main

sys.exit(main())
