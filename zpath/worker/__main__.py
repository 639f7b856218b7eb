import sys

from zpath.worker.server import main

sys.exit(main())
