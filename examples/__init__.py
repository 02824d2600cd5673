"""Example chain factories (``chimera train --chain examples.MODULE:factory``)."""
