"""The parts of axolotl 0.21.0 a plugin meets (see ../README.md); not axolotl itself."""

__version__ = "0.21.0"
