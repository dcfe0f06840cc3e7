import sys

from protrain.cli import main

sys.exit(main())
