import sys

from zpath.cluster.cli import main

sys.exit(main())
