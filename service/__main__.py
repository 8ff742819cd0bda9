"""`python -m service`: the gRPC server (the same as `esurge-serve`)."""

import sys

from service.cli import main

if __name__ == "__main__":
    sys.exit(main())
