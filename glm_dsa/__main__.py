"""``python -m glm_dsa``: the ``glm-dsa`` command."""

import sys

from glm_dsa.cli import main

sys.exit(main())
