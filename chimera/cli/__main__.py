"""``python -m chimera.cli``: the ``chimera`` command (without the Ray layer's ``train``)."""

import sys

from chimera.cli import main

sys.exit(main())
