import sys

from splitserve_cli.main import main

sys.exit(main())
