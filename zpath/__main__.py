import sys

from zpath.cli import main

sys.exit(main())
