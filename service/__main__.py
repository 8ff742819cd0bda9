"""`python -m service`: the gRPC server entry point."""

import sys


def main() -> int:
    """Refuse clearly until the server exists."""
    print("esurge-serve: the gRPC server is not implemented yet (see README, Status)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
