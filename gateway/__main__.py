import sys

from gateway.server import main

sys.exit(main())
