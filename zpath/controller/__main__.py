import sys

from zpath.controller.server import main

sys.exit(main())
